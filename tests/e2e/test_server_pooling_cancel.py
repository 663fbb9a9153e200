"""A client that goes away during a large ``/v1/embeddings`` or ``/rerank`` call: the
call's task tree is cancelled and every one of its engine requests aborted (the engine's
counters say so), and the server goes on serving. The embedding server serves a GGUF
file made Matryoshka by ``--hf-overrides`` (the file itself carries no such thing):
``dimensions`` it lists are answered, others are 400s.

One part at a time (``--max-num-seqs 1``), a small token budget and no prefix cache: a
part of at least ``L`` tokens takes at least ``ceil(L / budget)`` steps of its own, so
the steps the engine ran bound how many parts it finished; every other part must have
been aborted."""

from __future__ import annotations

import json
import math
import select
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.pooling import tiny_qwen3_classifier, tiny_st_qwen3
from tests.support.procs import wait_for
from tests.support.server import Server, open_stream

BUDGET = 8  # tokens per step
PARTS = 256
ARGS = ("--dtype", "float32", "--quantization", "none", "--max-model-len", "128")
ARGS += ("--kv-cache-memory", "16MiB", "--max-num-batched-tokens", str(BUDGET))
ARGS += ("--max-num-seqs", "1", "--no-prefix-caching")


@pytest.fixture(scope="module")
def embedder(default_files: Any) -> Iterator[Server]:
    from tests.support.llamacpp import convert_hf

    f32 = convert_hf(tiny_st_qwen3(default_files, plain=True), "f32")
    overrides = json.dumps({"matryoshka_dimensions": [16, 32, 64]})
    with Server(str(f32), *ARGS, "--hf-overrides", overrides) as s:
        yield s


@pytest.fixture(scope="module")
def reranker(default_files: Any) -> Iterator[Server]:
    with Server(str(tiny_qwen3_classifier(default_files)), *ARGS) as s:
        yield s


def counters(s: Server) -> tuple[float, float]:
    return s.metric("engine_steps_total"), s.metric("engine_requests_aborted_total")


def running_or_answered(s: Server, sock: socket.socket) -> bool:
    """True once the engine runs a part; fails at once if the call was answered (a
    400, say) before it ran."""
    if select.select([sock], [], [], 0)[0]:
        raise AssertionError(f"answered before it ran: {sock.recv(4096)[:300]!r}")
    return s.metric("num_requests_running") == 1


def disconnect_mid_call(s: Server, path: str, body: dict[str, Any], min_tokens: int) -> None:
    """Send ``body`` (``PARTS`` parts of at least ``min_tokens`` tokens each), close the
    socket once the engine runs its first part, and check that the parts it did not
    finish were all aborted and the server is idle and serving again."""
    steps0, aborted0 = counters(s)
    sock = open_stream(s.port, path, body)
    try:
        wait_for(lambda: running_or_answered(s, sock), "the call never ran")
    finally:
        sock.close()
    s.wait_idle()
    assert s.metric("num_open_requests") == 0
    steps, aborted = (b - a for a, b in zip((steps0, aborted0), counters(s), strict=True))
    finished = steps // math.ceil(min_tokens / BUDGET)  # at most, one part at a time
    assert finished < PARTS  # the call was cut short: not all its work was done...
    assert aborted >= PARTS - finished  # ...and every part not finished was aborted
    assert aborted <= PARTS


def test_disconnect_aborts_every_embedding(embedder: Server) -> None:
    length = 64
    ids = [[(7 + 13 * i + 31 * j) % 4000 + 10 for j in range(length)] for i in range(PARTS)]
    disconnect_mid_call(embedder, "/v1/embeddings", {"input": ids}, length)
    status, out = embedder.post(
        "/v1/embeddings", {"input": "still here", "encoding_format": "float"}
    )
    assert status == 200 and len(out["data"][0]["embedding"]) == 64


def test_disconnect_aborts_every_rerank_pair(reranker: Server) -> None:
    # each document alone is 30 tokens or more (30 words); no two share a prefix block
    docs = [f"{i} " + " ".join(f"w{(i * 7 + k) % 97}" for k in range(30)) for i in range(PARTS)]
    disconnect_mid_call(reranker, "/rerank", {"query": "q", "documents": docs}, 30)
    status, out = reranker.post("/rerank", {"query": "q", "documents": ["a", "b"]})
    assert status == 200 and len(out["results"]) == 2


def test_gguf_matryoshka_through_hf_overrides(embedder: Server) -> None:
    status, full = embedder.post("/v1/embeddings", {"input": "hello", "encoding_format": "float"})
    assert status == 200
    status, cut = embedder.post(
        "/v1/embeddings", {"input": "hello", "encoding_format": "float", "dimensions": 16}
    )
    assert status == 200, cut
    vec = cut["data"][0]["embedding"]
    head = full["data"][0]["embedding"][:16]  # the cut, then normalisation
    norm = math.sqrt(sum(x * x for x in head))
    assert len(vec) == 16 and max(abs(a - b / norm) for a, b in zip(vec, head, strict=True)) < 1e-5
    status, out = embedder.post("/v1/embeddings", {"input": "hello", "dimensions": 24})
    assert status == 400, out
    assert out["error"]["param"] == "dimensions" and "[16, 32, 64]" in out["error"]["message"]
