"""``POST /score`` and ``POST /rerank`` (``/v1/rerank``, ``/v2/rerank``) on a pooling
runner whose model scores (a reranker, ``model.pooler_config``), in vLLM's shapes.

``/score`` pairs ``text_1`` with ``text_2`` (one first text against each second, or
the two lists pairwise); ``/rerank`` scores ``query`` against each of ``documents``
(Jina's and Cohere's shape: ``results`` sorted by ``relevance_score``, the first
``top_n``, each document echoed). Each pair is tokenized as a cross-encoder's input
(``Tokenizer.encode_pair``) in the worker pool and scored as one engine request
(``server.embeddings.pooled``: all in flight at once, the client's leaving aborts them).
"""

from __future__ import annotations

import sys
import time
import uuid
from array import array

import msgspec

from structllm.protocol import PoolingParams
from structllm.server import requests as rq
from structllm.server.embeddings import MAX_INPUTS, no_adapter, pooled
from structllm.server.errors import APIError
from structllm.server.generation import Transport
from structllm.server.pipeline import PoolingPipeline, Receive, Scope, Send


class ScoreRequest(msgspec.Struct, frozen=True):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    # keep N of each pair's tokens (-1: all that fit): the last, or an encoder's head
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class RerankRequest(msgspec.Struct, frozen=True):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None  # the best N results (None or 0: all)
    truncate_prompt_tokens: int | None = None
    return_documents: bool = True  # (Cohere's) echo each document
    user: str | None = None


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """``/score``'s pairs as vLLM forms them; 400 naming the field otherwise."""
    firsts = [text_1] if isinstance(text_1, str) else text_1
    seconds = [text_2] if isinstance(text_2, str) else text_2
    for name, texts in (("text_1", firsts), ("text_2", seconds)):
        if not texts:
            raise APIError(400, f"{name} must not be empty", param=name)
        if any(not t for t in texts):
            raise APIError(400, f"{name} holds an empty string", param=name)
    if len(firsts) == 1:
        return [(firsts[0], s) for s in seconds]
    if len(firsts) != len(seconds):
        raise APIError(
            400,
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, "
            "or as many as text_2",
            param="text_1",
        )
    return list(zip(firsts, seconds, strict=True))


def tokenize_pairs(
    app: PoolingPipeline, pairs: list[tuple[str, str]], keep: int | None, param: str
) -> list[list[int]]:
    """Each pair's tokens (in the worker pool), ``truncate_prompt_tokens`` applied, then
    the context's bound (400 unless truncation was asked for)."""
    if len(pairs) > MAX_INPUTS:
        raise APIError(400, f"{len(pairs)} pairs; at most {MAX_INPUTS} are allowed", param=param)
    limit = app.max_model_len or sys.maxsize
    info = app.engine().ready.pooler
    assert info is not None, "a scorer's (_check_scorer)"
    if keep is not None and (keep == 0 or keep < -1 or keep > limit):
        raise APIError(
            400,
            f"truncate_prompt_tokens must be -1 or in [1, {limit}]",
            param="truncate_prompt_tokens",
        )
    out: list[list[int]] = []
    for i, (a, b) in enumerate(pairs):
        ids = app.tokenizer.encode_pair(a, b)
        if keep is not None:
            ids = info.cut(ids, limit if keep == -1 else keep)
        if len(ids) > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, pair {i} "
                f"has {len(ids)} tokens. Please reduce the length of the input, or set "
                "truncate_prompt_tokens.",
                param=param,
                code="context_length_exceeded",
            )
        out.append(ids)
    return out


def _check_scorer(app: PoolingPipeline, api: str) -> None:
    info = app.engine().ready.pooler
    if info is None or info.task != "score":
        raise APIError(400, f"The model does not support {api} API", param="model")


async def _scores(
    app: PoolingPipeline, receive: Receive, prompts: list[list[int]], param: str
) -> list[float] | None:
    vecs = await pooled(app, receive, prompts, PoolingParams("score"), param)
    return None if vecs is None else [array("f", v)[0] for v in vecs]


async def score(app: PoolingPipeline, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /score``."""
    req = rq.decode_body(await app.read_body(receive), ScoreRequest)
    no_adapter(app, req.model)
    _check_scorer(app, "Score")
    pairs = score_pairs(req.text_1, req.text_2)
    prompts = await app.in_worker(tokenize_pairs, app, pairs, req.truncate_prompt_tokens, "text_2")
    scores = await _scores(app, receive, prompts, "text_2")
    if scores is None:  # the client went away
        return
    total = sum(len(p) for p in prompts)
    body = {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": app.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }
    await Transport(send).json(200, body)


async def rerank(app: PoolingPipeline, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``."""
    req = rq.decode_body(await app.read_body(receive), RerankRequest)
    no_adapter(app, req.model)
    _check_scorer(app, "Rerank")
    if not req.query:
        raise APIError(400, "query must not be empty", param="query")
    if not req.documents:
        raise APIError(400, "documents must not be empty", param="documents")
    if any(not d for d in req.documents):
        raise APIError(400, "documents holds an empty string", param="documents")
    if req.top_n is not None and req.top_n < 0:
        raise APIError(400, f"top_n must be >= 0, got {req.top_n}", param="top_n")
    pairs = [(req.query, d) for d in req.documents]
    prompts = await app.in_worker(
        tokenize_pairs, app, pairs, req.truncate_prompt_tokens, "documents"
    )
    scores = await _scores(app, receive, prompts, "documents")
    if scores is None:  # the client went away
        return
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or None]
    results = [
        {
            "index": i,
            **({"document": {"text": req.documents[i]}} if req.return_documents else {}),
            "relevance_score": scores[i],
        }
        for i in order
    ]
    body = {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": app.model_name,
        "usage": {"total_tokens": sum(len(p) for p in prompts)},
        "results": results,
    }
    await Transport(send).json(200, body)
