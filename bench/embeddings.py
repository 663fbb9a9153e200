r"""Embeddings: structllm's ``/v1/embeddings`` against sentence-transformers on the same
directory and, given a GGUF file of the same model, llama.cpp's
``llama-server --embeddings``, same threads, in one run.

Workloads (issue #42's): single short queries (8-16 words) at concurrency 1 and 8
(latency p50/p90 per request), and bulk batches of 32 passages of 256-512 tokens
(passages/s). sentence-transformers runs in this process (``encode`` with batch 32 for
the bulk, one text at a time for the latency rows, ``torch.set_num_threads``); the
servers over HTTP with one text per request (the latency rows) or 32 per request (bulk).

Without ``--model``, a Qwen3-Embedding-shaped model is built from its config with
seeded random weights (``--shape``: ``0.6b``, Qwen3-Embedding-0.6B's shape, or
``small``: hidden 256, 4 layers), saved by sentence-transformers with the default
model's tokenizer and cached; the weights do not change the cost. ``--shape bge-base``
is a BERT encoder instead (bge-base-en-v1.5's shape: hidden 768, 12 layers, 12 heads,
MLP 3072, 512 positions; mean pooling, normalised), with a WordPiece vocabulary that
holds the benchmark's words whole (one token a word, as the decoder's tokenizer gives);
its passages are 256-510 words (BERT's 512 positions less ``[CLS]`` and ``[SEP]``).

    python bench/embeddings.py [--model DIR] [--shape small|0.6b] [--threads 2]
        [--formats float32:none,auto:auto] [--llama-server PATH] [--gguf FILE]
        [--gguf-type Q8_0] [--queries 64] [--bulk-batches 4]

With ``--llama-server`` and no ``--gguf``, the synthetic model is converted by
llama.cpp's converter and requantised (``--gguf-type``); structllm serves that file too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

SHAPES: dict[str, dict[str, object]] = {
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
# BERT encoders (``tests.support.encoders``' builders at these sizes)
ENCODER_SHAPES: dict[str, dict[str, object]] = {
    "bge-base": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        max_position_embeddings=512,
    ),
}
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "they",
    "this",
    "which",
    "model",
    "token",
    "vector",
    "search",
    "query",
    "passage",
    "document",
    "retrieval",
    "ranking",
    "server",
    "engine",
    "cache",
    "memory",
    "thread",
    "kernel",
    "batch",
    "latency",
    "throughput",
    "river",
    "mountain",
    "city",
    "library",
]


def encoder_size(shape: str) -> Any:
    """``tests.support.encoders.Size`` of an ``ENCODER_SHAPES`` entry with this
    benchmark's words."""
    from tests.support.encoders import Size

    return Size(dict(ENCODER_SHAPES[shape]), tuple(WORDS))


def passage_words(shape: str) -> tuple[int, int]:
    """Words per bulk passage: 256-512, or what an encoder's positions hold."""
    if shape in ENCODER_SHAPES:
        return 256, int(ENCODER_SHAPES[shape]["max_position_embeddings"]) - 2  # type: ignore[call-overload]
    return 256, 512


def max_len(shape: str) -> int:
    """The servers' ``--max-model-len``: 1024, or an encoder's positions."""
    if shape in ENCODER_SHAPES:
        return int(ENCODER_SHAPES[shape]["max_position_embeddings"])  # type: ignore[call-overload]
    return 1024


def synthetic_model(shape: str) -> Path:
    """The cached Qwen3-Embedding-shaped sentence-transformers directory of ``shape``,
    with the default model's tokenizer as it is (which llama.cpp's converter takes), or
    an ``ENCODER_SHAPES`` BERT embedder."""
    from structllm.model.loader import prepare_model
    from tests.support import pooling

    if shape in ENCODER_SHAPES:
        from tests.support.encoders import tiny_st_encoder

        return tiny_st_encoder("bert", encoder_size(shape))
    files = prepare_model(None)
    return pooling.tiny_st_qwen3(files, plain=True, **SHAPES[shape], max_position_embeddings=1024)


def gguf_of(model: Path, qtype: str) -> Path:
    """``model`` converted by llama.cpp's converter (F32), requantised to ``qtype``. A
    WordPiece tokenizer (the encoders') goes under the name real BERT files carry, as
    the converter cannot recognise a made-up one by its hash."""
    from tests.support.llamacpp import convert_hf, quantize

    kind = json.loads((model / "tokenizer.json").read_text())["model"]["type"]
    f32 = convert_hf(model, "f32", pre="bert-bge" if kind == "WordPiece" else "")
    return f32 if qtype == "F32" else quantize(f32, qtype)


def texts(n: int, lo: int, hi: int, seed: int) -> list[str]:
    """``n`` texts of ``lo``-``hi`` words (about as many tokens)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout: float = 900) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become healthy")


def latencies(fn: Any, items: list[str], concurrency: int) -> list[float]:
    def one(t: str) -> float:
        start = time.perf_counter()
        fn([t])
        return time.perf_counter() - start

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, items))


def measure(name: str, embed: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One arm's rows: ``embed(list_of_texts)`` embeds them (one call, one request)."""
    queries = texts(args.queries, 8, 16, 1)
    passages = texts(32 * args.bulk_batches, *passage_words(args.shape), 2)
    embed(queries[:4])  # warm-up
    row: dict[str, Any] = {"arm": name}
    for c in (1, 8):
        lat = sorted(latencies(embed, queries, c))
        row[f"c{c}_p50_ms"] = 1000 * statistics.median(lat)
        row[f"c{c}_p90_ms"] = 1000 * lat[int(0.9 * (len(lat) - 1))]
    start = time.perf_counter()
    for b in range(args.bulk_batches):
        embed(passages[32 * b : 32 * (b + 1)])
    row["bulk_passages_s"] = len(passages) / (time.perf_counter() - start)
    print(json.dumps(row), flush=True)
    return row


def structllm_arm(
    model: Path, fmt: str, args: argparse.Namespace, name: str = ""
) -> dict[str, Any]:
    from tests.support.server import free_port

    dtype, quant = fmt.split(":")
    port = free_port()
    cmd = [sys.executable, "-m", "structllm", "run", str(model), "--port", str(port)]
    cmd += ["--dtype", dtype, "--quantization", quant, "--engine-threads", str(args.threads)]
    cmd += ["--max-model-len", str(max_len(args.shape)), "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)

        def embed(items: list[str]) -> None:
            post(url + "/v1/embeddings", {"input": items, "encoding_format": "base64"})

        return measure(name or f"structllm {fmt}", embed, args)
    finally:
        proc.terminate()
        proc.wait()


def llama_arm(args: argparse.Namespace) -> dict[str, Any]:
    from llama_server import LlamaServer

    flags = ["--embeddings", "-t", str(args.threads), "-c", "8192", "-np", "8"]
    flags += ["-b", "4096", "-ub", "4096"]
    # one KV cache for the 8 slots: without it (what an explicit -np gives) each
    # request cost ~0.7-1.2 s here at 2 threads, even a 15-token query
    flags += ["--kv-unified"]
    with LlamaServer(args.llama_server, args.gguf, flags) as server:

        def embed(items: list[str]) -> None:
            post(server.url + "/v1/embeddings", {"input": items})

        return measure("llama-server", embed, args)


def st_arm(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    st = SentenceTransformer(str(model), device="cpu")

    def embed(items: list[str]) -> None:
        st.encode(items, batch_size=32)

    return measure("sentence-transformers", embed, args)


def hold_to_avx2() -> None:
    """With ``STRUCTLLM_CPU_ISA=avx2``, hold torch's own kernels to AVX2 too, in this
    process (sentence-transformers) and the servers it starts: MKL's sgemm
    (``MKL_ENABLE_INSTRUCTIONS``), oneDNN (``ONEDNN_MAX_CPU_ISA``) and ATen's vectorised
    ops (``ATEN_CPU_CAPABILITY``) pick AVX-512 on this CPU otherwise, so that
    sentence-transformers' "AVX2" figures were AVX-512 ones (MKL's float32 matmuls of
    one 0.6b layer at 512 rows ran 1.12-1.29x faster unheld, three interleaved runs at
    load ~14). fbgemm's float16 matmul (structllm's ``auto`` on a float directory) has
    no such switch: that arm stays AVX-512 here. Call before torch loads."""
    if os.environ.get("STRUCTLLM_CPU_ISA") == "avx2":
        os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a sentence-transformers directory (default: synthetic)")
    p.add_argument("--shape", choices=sorted(SHAPES) + sorted(ENCODER_SHAPES), default="small")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--formats",
        default="float32:none,auto:auto",
        help="structllm arms on the directory, dtype:quantization (empty: none)",
    )
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    p.add_argument(
        "--gguf",
        help="the same model as a GGUF file, for llama-server and structllm (default, with "
        "--llama-server: the synthetic model converted, --gguf-type)",
    )
    p.add_argument("--gguf-type", default="Q8_0", help="F32, or a llama-quantize type")
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--bulk-batches", type=int, default=4)
    args = p.parse_args()
    hold_to_avx2()
    model = Path(args.model) if args.model else synthetic_model(args.shape)
    rows = [structllm_arm(model, f, args) for f in args.formats.split(",") if f]
    rows.append(st_arm(model, args))
    if args.llama_server and not args.gguf:
        args.gguf = str(gguf_of(model, args.gguf_type))
    if args.gguf:
        rows.append(structllm_arm(Path(args.gguf), "auto:auto", args, "structllm GGUF"))
    if args.llama_server and args.gguf:
        rows.append(llama_arm(args))
    print(f"\nmodel {model} threads {args.threads}")
    keys = ["c1_p50_ms", "c1_p90_ms", "c8_p50_ms", "c8_p90_ms", "bulk_passages_s"]
    print(f"{'arm':28}" + "".join(f"{k:>17}" for k in keys))
    for r in rows:
        print(f"{r['arm']:28}" + "".join(f"{r[k]:17.1f}" for k in keys))


if __name__ == "__main__":
    main()
