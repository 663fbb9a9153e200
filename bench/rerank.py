r"""Rerank latency: one query against N documents, structllm's ``/rerank`` against
llama.cpp's ``llama-server --reranking`` on the same GGUF file, same threads, both
servers up at once and their requests interleaved (A, B, A, B, ...), so drift in the
machine's speed hits both alike (issue #42's "one query against 50 documents").

Without ``--gguf``, a Qwen3-Reranker-shaped causal LM is built from its config with
seeded random weights (``--shape``: ``small``, hidden 256 and 4 layers, or ``0.6b``,
Qwen3-Reranker-0.6B's shape; untied head), with the default model's tokenizer, converted
by llama.cpp's converter (which writes it as RANK pooling: the head's ``yes``/``no``
rows) and requantised (``--gguf-type``); cached. The weights do not change the cost.
``--shape bge-base``: a BERT cross-encoder instead (``BertForSequenceClassification``,
one label, bge-reranker-base's layers at BERT-base's size, a WordPiece vocabulary
holding the benchmark's words whole), which sentence-transformers' ``CrossEncoder``
also scores, in this process, as a third arm in the same interleaved rounds (what the
servers' requests score: the query paired with each document, batch 32).

    python bench/rerank.py --llama-server /root/llama-build-avx512/bin/llama-server \
        [--shape small|0.6b|bge-base] [--gguf FILE] [--gguf-type Q8_0] [--threads 2] \
        [--documents 50] [--words 48,96] [--reps 10]

Prints each side's latency (p50 and best, ms), its tokens per request (what it reports
in ``usage``: llama-server wraps each pair in its own rerank format), the ratio, and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

from bench.embeddings import (
    ENCODER_SHAPES,
    SHAPES,
    encoder_size,
    gguf_of,
    hold_to_avx2,
    max_len,
    post,
    texts,
    wait_healthy,
)


def synthetic_reranker(shape: str) -> Path:
    """The cached Qwen3-Reranker-shaped directory of ``shape`` (its name says
    ``reranker``, which is how llama.cpp's converter knows it)."""
    from structllm.model.loader import prepare_model
    from tests.support.pooling import tiny_qwen3_reranker

    if shape in ENCODER_SHAPES:
        from tests.support.encoders import tiny_cross_encoder

        return tiny_cross_encoder("bert", encoder_size(shape))
    return tiny_qwen3_reranker(prepare_model(None), **SHAPES[shape], max_position_embeddings=1024)


@contextmanager
def serving(cmd: list[str], port: int) -> Iterator[str]:
    """``cmd`` running until healthy at ``port``; its URL. Stopped on the way out."""
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        yield url
    finally:
        proc.terminate()
        proc.wait()


def structllm_cmd(gguf: Path, port: int, threads: int, shape: str) -> list[str]:
    cmd = [sys.executable, "-m", "structllm", "run", str(gguf), "--port", str(port)]
    return cmd + ["--engine-threads", str(threads), "--max-model-len", str(max_len(shape))]


def llama_flags(threads: int) -> list[str]:
    """llama-server's flags besides the model, host and port (``LlamaServer``'s)."""
    flags = ["--reranking", "-t", str(threads)]
    # 16 slots sharing one KV cache (--kv-unified: without it, what an explicit -np
    # gives, each request cost seconds here at 2 threads), pairs batched 4096 tokens a
    # ubatch
    return flags + ["-c", "16384", "-np", "16", "-b", "4096", "-ub", "4096", "--kv-unified"]


def cross_encoder(model: Path, threads: int, body: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """sentence-transformers' ``CrossEncoder`` on ``model`` scoring ``body``'s pairs, as
    a call answering like the servers' (``usage``: the pairs' tokens)."""
    import torch
    from sentence_transformers import CrossEncoder

    torch.set_num_threads(threads)
    ce = CrossEncoder(str(model), device="cpu")
    pairs = [(body["query"], d) for d in body["documents"]]
    q = ce.tokenizer([body["query"]] * len(pairs), body["documents"])["input_ids"]
    n = sum(len(ids) for ids in q)

    def call() -> dict[str, Any]:
        ce.predict(pairs, batch_size=32)
        return {"usage": {"total_tokens": n}}

    return call


def timed(call: Callable[[], dict[str, Any]]) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    out = call()
    return time.perf_counter() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    p.add_argument("--gguf", help="a reranker GGUF file (default: the synthetic one)")
    p.add_argument("--shape", choices=sorted(SHAPES) + sorted(ENCODER_SHAPES), default="small")
    p.add_argument("--gguf-type", default="Q8_0", help="F32, or a llama-quantize type")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--documents", type=int, default=50)
    p.add_argument("--words", default="48,96", help="words per document: lo,hi")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    hold_to_avx2()
    from tests.support.server import free_port

    source = None if args.gguf else synthetic_reranker(args.shape)
    gguf = Path(args.gguf) if source is None else gguf_of(source, args.gguf_type)
    lo, hi = (int(x) for x in args.words.split(","))
    body = {"query": texts(1, 8, 12, 3)[0], "documents": texts(args.documents, lo, hi, 4)}
    from llama_server import LlamaServer

    p1 = free_port()
    with (
        serving(structllm_cmd(gguf, p1, args.threads, args.shape), p1) as ours,
        LlamaServer(args.llama_server, gguf, llama_flags(args.threads)) as theirs,
    ):
        arms: dict[str, Callable[[], dict[str, Any]]] = {
            "structllm": partial(post, ours + "/rerank", body),
            "llama-server": partial(post, theirs.url + "/rerank", body),
        }
        if source is not None and args.shape in ENCODER_SHAPES:
            arms["sentence-transf."] = cross_encoder(source, args.threads, body)
        times: dict[str, list[float]] = {a: [] for a in arms}
        tokens: dict[str, int] = {}
        for name, call in arms.items():  # warm-up, and each side's token count
            tokens[name] = int(call()["usage"]["total_tokens"])
        for _ in range(args.reps):
            for name, call in arms.items():
                dt, _out = timed(call)
                times[name].append(dt)
    rows = {
        a: {"p50_ms": 1000 * statistics.median(t), "best_ms": 1000 * min(t), "tokens": tokens[a]}
        for a, t in times.items()
    }
    print(f"{gguf.name}: 1 query x {args.documents} documents, {args.threads} threads")
    print(f"{'arm':<18}{'p50 ms':>10}{'best ms':>10}{'tokens':>8}")
    for a, r in rows.items():
        print(f"{a:<18}{r['p50_ms']:>10.1f}{r['best_ms']:>10.1f}{r['tokens']:>8}")
    ratio = rows["llama-server"]["p50_ms"] / rows["structllm"]["p50_ms"]
    print(f"llama-server p50 / structllm p50: {ratio:.2f}x")
    for a in rows.keys() - {"structllm", "llama-server"}:
        print(f"{a} p50 / structllm p50: {rows[a]['p50_ms'] / rows['structllm']['p50_ms']:.2f}x")
    print(json.dumps({"gguf": gguf.name, "documents": args.documents, **rows, "ratio": ratio}))


if __name__ == "__main__":
    main()
