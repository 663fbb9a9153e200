"""``POST /v1/embeddings`` (OpenAI's shape, vLLM's extras) on a pooling runner.

The body's ``input`` (a string, a list of strings, token ids, or a list of token-id
lists) is checked and tokenized in the worker pool (text gets the model's default
prompt, ``PoolerInfo.prompt``); each input becomes one engine request with
``PoolingParams`` (``dimensions``), all sent at once so the engine batches them by its
token budget; the vectors come back as float32 bytes, answered as floats or, with
``encoding_format: "base64"`` (what the ``openai`` client asks for), as the base64 of
those very bytes (little-endian float32, OpenAI's encoding). The client going away
cancels the task group, and leaving each request's context aborts it in the engine.
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import anyio
import msgspec

from structllm.client import RequestStream
from structllm.protocol import PoolerInfo, PoolingParams, SamplingParams
from structllm.server import requests as rq
from structllm.server.errors import APIError
from structllm.server.generation import Transport
from structllm.server.pipeline import PoolingPipeline, Receive, Scope, Send

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit)
PROMPT_ONLY = SamplingParams(temperature=0.0, max_tokens=0)


class EmbeddingRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    input: Any
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's: keep N tokens of each input (-1: all that fit), the last or an encoder's head
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True  # vLLM's


def inputs(value: Any) -> list[str | list[int]]:
    """The body's ``input`` as a list of texts and token-id lists; 400 naming what is
    wrong (empty, too many, neither text nor token ids)."""
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(type(t) is int for t in value)
    ):
        items: list[Any] = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise APIError(
            400,
            "input must be a string, a list of strings or of token ids",
            "invalid_request_error",
            "input",
        )
    if not items:
        raise APIError(400, "input must not be empty", param="input")
    if len(items) > MAX_INPUTS:
        raise APIError(
            400, f"input has {len(items)} items; at most {MAX_INPUTS} are allowed", param="input"
        )
    for i, it in enumerate(items):
        ok_ids = isinstance(it, list) and it and all(type(t) is int for t in it)
        if not (isinstance(it, str) or ok_ids):
            raise APIError(
                400,
                f"input[{i}] must be a non-empty string or a non-empty list of token ids",
                param="input",
            )
        if isinstance(it, str) and not it:
            raise APIError(400, f"input[{i}] is an empty string", param="input")
    return items


def no_adapter(app: PoolingPipeline, model: str | None) -> None:
    """404 for an unknown ``model``; 400 for a LoRA adapter's name (the pooling runner
    runs the base model only)."""
    if app.check_model(model) is not None:
        raise APIError(
            400, f"LoRA adapter {model!r} cannot pool: the base model only", param="model"
        )


def check_dimensions(info: PoolerInfo, dimensions: int | None, model: str) -> None:
    """400 for a ``dimensions`` the model cannot give (as vLLM answers)."""
    if dimensions is None:
        return
    if not info.matryoshka:
        raise APIError(
            400,
            f'Model "{model}" does not support matryoshka representation, changing output '
            "dimensions will lead to poor results.",
            param="dimensions",
        )
    if dimensions < 1 or dimensions > info.size:
        raise APIError(
            400, f"dimensions must be in [1, {info.size}], got {dimensions}", param="dimensions"
        )
    dims = info.matryoshka_dimensions
    if dims and dimensions not in dims:
        raise APIError(
            400, f"dimensions must be one of {dims}, got {dimensions}", param="dimensions"
        )


def tokenize(
    app: PoolingPipeline, req: EmbeddingRequest, items: list[str | list[int]], info: PoolerInfo
) -> list[list[int]]:
    """Each input's token ids (in the worker pool): text with the default prompt, ids
    checked against the vocabulary, ``truncate_prompt_tokens`` applied, then the
    context's bound (400 unless truncation was asked for)."""
    limit = app.max_model_len or sys.maxsize
    keep = req.truncate_prompt_tokens
    if keep is not None and (keep == 0 or keep < -1):
        raise APIError(
            400, "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens"
        )
    if keep is not None and keep > limit:
        raise APIError(
            400,
            f"truncate_prompt_tokens {keep} exceeds max_model_len {limit}",
            param="truncate_prompt_tokens",
        )
    vocab = app.engine().ready.vocab_size
    out: list[list[int]] = []
    for i, it in enumerate(items):
        if isinstance(it, str):
            ids = app.tokenizer.encode(info.prompt + it, req.add_special_tokens)
        else:
            ids = it
            rq.check_token_ids(ids, vocab, f"input[{i}]")
        if keep is not None:
            ids = info.cut(ids, limit if keep == -1 else keep)
        if len(ids) > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, input[{i}] "
                f"has {len(ids)} tokens. Please reduce the length of the input, or set "
                "truncate_prompt_tokens.",
                param="input",
                code="context_length_exceeded",
            )
        if not ids:
            raise APIError(400, f"input[{i}] has no tokens", param="input")
        out.append(ids)
    return out


async def pooled(
    app: PoolingPipeline,
    receive: Receive,
    prompts: list[list[int]],
    params: PoolingParams,
    param: str = "input",
) -> list[bytes] | None:
    """Each prompt's vector from the engine, all in flight at once under one admission
    (the call's inputs are one client's request); None if the client went away (the
    task group is cancelled, and leaving each request's context aborts it). An engine
    refusal is a 400 naming ``param[i]``."""
    client = app.engine()
    out: list[bytes] = [b""] * len(prompts)
    done = False

    async def one(i: int, ids: list[int]) -> None:
        rid = client.new_request_id("pool")
        async with client.request(rid, ids, PROMPT_ONLY, pooling=params) as stream:
            out[i] = await _vector(stream, f"{param}[{i}]", param)

    with app.admission.admit([sum(len(p) for p in prompts)]), _api_error_out():
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            async def run() -> None:
                nonlocal done
                async with anyio.create_task_group() as inner:
                    for i, ids in enumerate(prompts):
                        inner.start_soon(one, i, ids)
                done = True
                tg.cancel_scope.cancel()

            tg.start_soon(watch_disconnect)
            tg.start_soon(run)
    return out if done else None


@contextmanager
def _api_error_out() -> Iterator[None]:
    """An ``APIError`` out of the task groups as itself (the app answers it), not
    wrapped in their exception group."""
    try:
        yield
    except BaseExceptionGroup as group:
        found = group.subgroup(APIError)
        while found is not None and isinstance(found.exceptions[0], BaseExceptionGroup):
            found = found.exceptions[0]
        if found is not None:
            raise found.exceptions[0] from None
        raise


async def _vector(stream: RequestStream, name: str, param: str) -> bytes:
    from structllm.client import EngineRequestError

    try:
        while True:
            d = await stream.get()
            if d.finish_reason is not None:
                if d.pooled is None:
                    raise APIError(500, f"{name} ended without a vector", "internal_server_error")
                return d.pooled
    except EngineRequestError as e:
        raise APIError(400, f"{name}: {e}", param=param) from None


def encode(vec: bytes, fmt: str) -> list[float] | str:
    """One vector as OpenAI answers it: floats, or base64 of little-endian float32."""
    if fmt == "base64":
        if sys.byteorder != "little":
            a = array("f", vec)
            a.byteswap()
            vec = a.tobytes()
        return base64.b64encode(vec).decode()
    return array("f", vec).tolist()


async def embeddings(app: PoolingPipeline, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/embeddings``."""
    req = rq.decode_body(await app.read_body(receive), EmbeddingRequest)
    no_adapter(app, req.model)
    client = app.engine()
    info = client.ready.pooler
    if info is None or info.task != "embed":
        raise APIError(400, "The model does not support Embeddings API", param="model")
    items = inputs(req.input)
    check_dimensions(info, req.dimensions, app.model_name)
    prompts = await app.in_worker(tokenize, app, req, items, info)
    vecs = await pooled(app, receive, prompts, PoolingParams("embed", req.dimensions))
    if vecs is None:  # the client went away
        return
    total = sum(len(p) for p in prompts)
    data = [
        {"object": "embedding", "index": i, "embedding": encode(v, req.encoding_format)}
        for i, v in enumerate(vecs)
    ]
    body = {
        "object": "list",
        "data": data,
        "model": app.model_name,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }
    await Transport(send).json(200, body)
