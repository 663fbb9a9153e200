"""The offline API's pooling side (``LLM.embed``, ``LLM.score``): one vector (or one
score) per prompt from an engine that runs the pooling runner (``engine.pooling``), in
this process.

The vectors arrive as float32 bytes (``TokenDelta.pooled``); ``vector`` reads them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from structllm.protocol import AddRequest, PoolerInfo, PoolingParams

if TYPE_CHECKING:
    from structllm.engine.core import EngineCore


class EmbeddingOutput(msgspec.Struct):
    embedding: list[float]


class EmbeddingRequestOutput(msgspec.Struct):
    """One prompt's embedding (vLLM's shape: ``output.outputs.embedding``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


class ScoringOutput(msgspec.Struct):
    score: float


class ScoringRequestOutput(msgspec.Struct):
    """One pair's relevance score (vLLM's shape: ``output.outputs.score``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput


def pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """Score pairs as vLLM forms them: one first text against each second (1:N), or the
    two lists pairwise (N:N, equal lengths); ``ValueError`` otherwise."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise ValueError("score needs at least one text on each side")
    if len(firsts) == 1:
        return [(firsts[0], s) for s in seconds]
    if len(firsts) != len(seconds):
        raise ValueError(
            f"score pairs {len(firsts)} first texts with {len(seconds)} second texts: "
            "give one first text, or as many as second texts"
        )
    return list(zip(firsts, seconds, strict=True))


def vector(pooled: bytes) -> list[float]:
    """A pooled vector's float32 bytes (native order) as floats."""
    return array("f", pooled).tolist()


def truncate(ids: list[int], keep: int | None, max_model_len: int, info: PoolerInfo) -> list[int]:
    """``truncate_prompt_tokens`` as vLLM applies it: ``keep`` tokens (``-1``:
    ``max_model_len``), the input's tail or an encoder's head (``PoolerInfo.cut``);
    ``None`` keeps all."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}")
    return info.cut(ids, keep)


def pool(
    engine: EngineCore, encoded: Sequence[list[int]], params: PoolingParams, id_prefix: str
) -> list[bytes]:
    """Each prompt's pooled vector, in order, run as one batch. ``ValueError`` naming
    the prompt if one can never run (empty, too long, ids outside the vocabulary, a
    ``dimensions`` the model cannot cut, a model that runs the generate runner)."""
    from structllm.engine.core import PROMPT_ONLY

    msgs = [
        AddRequest(f"{id_prefix}-{i}", ids, PROMPT_ONLY, pooling=params)
        for i, ids in enumerate(encoded)
    ]
    for i, msg in enumerate(msgs):
        try:
            engine.check_pooling(msg)
            engine.check_request(msg.prompt_token_ids, PROMPT_ONLY)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
    out: dict[str, bytes] = {}
    live = {m.request_id for m in msgs}
    try:
        for m in msgs:
            engine.add_request(m)
        while live:
            for d in engine.step().outputs:
                if d.request_id not in live:
                    continue
                if d.error is not None:
                    raise RuntimeError(f"engine refused request: {d.error}")
                if d.finish_reason is not None:
                    live.discard(d.request_id)
                    if d.pooled is None:
                        raise RuntimeError(f"request {d.request_id} ended without a vector")
                    out[d.request_id] = d.pooled
    finally:
        if live:  # interrupted: leave nothing running in the engine
            engine.abort(list(live))
    return [out[m.request_id] for m in msgs]
