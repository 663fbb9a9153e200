r"""Long-prompt prefill on the CPU engine: prompt tokens/s at several prompt lengths, the
tiled prefill attention kernel against the row-by-row path it replaced, in the same run.

Offline engine (``LLM``, the default model unless ``--model``), one prompt at a time of
``--lengths`` random token ids (fixed seed, a different prompt per length and per
backend so that no prefix-cache hit flatters either), one output token: the time is the
prompt's prefill, chunked by the engine's own step budget as a served request would be.
Each prompt length is timed ``--reps`` times per path, interleaved, best kept.

The "rows" path is the previous ``CpuAttention.prefill``: every prompt row a decode over
its own context through ``paged_decode`` (each row re-reads its whole context, so long
prompts fall out of the caches). ``--attention-only`` times the attention call alone on
one layer's shape instead of the engine.

    python bench/prefill.py [--lengths 512,2048,8000] [--paths tiled,rows]
    python bench/prefill.py --attention-only --lengths 512,2048,8000
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

import torch

from structllm.kernels import cpu_ext
from structllm.kernels.attention import AttentionMetadata, CpuAttention


def row_prefill(
    self: CpuAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The previous prefill: row ``r`` of a chunk is a decode over its first
    ``ctx - q_len + r + 1`` keys (``[T]`` lengths, ``[T, MB]`` repeated block tables)."""
    nd = meta.num_decodes
    starts = meta.query_start_list[nd:]
    q_lens = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
    ctxs = meta.seq_lens_list[nd:]
    lens = torch.cat(
        [
            torch.arange(c - n + 1, c + 1, dtype=torch.int32)
            for c, n in zip(ctxs, q_lens, strict=True)
        ]
    )
    tables = meta.block_tables[nd : nd + len(q_lens)].repeat_interleave(torch.tensor(q_lens), dim=0)
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    self._decode(out, q, k_cache, v_cache, tables, lens, scale, window, softcap)
    return out


def attention_only(
    args: argparse.Namespace, lengths: list[int], paths: list[str]
) -> dict[str, Any]:
    """One layer's prefill attention of a whole prompt (SmolLM2-135M's shape by default),
    blocks shuffled, per path: milliseconds and the two paths' largest difference."""
    module = cpu_ext.load()
    assert module is not None, "the C++ attention kernel did not build"
    impl = CpuAttention(module)
    h, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, 16
    dtype = {"float32": torch.float32, "float16": torch.float16}[args.kv_cache_dtype]
    res: dict[str, Any] = {}
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        nb = -(-n // bs)
        tables = torch.randperm(nb, generator=g).to(torch.int32).view(1, nb)
        kc = torch.zeros(impl.k_cache_shape(nb, bs, hkv, d), dtype=dtype)
        vc = torch.zeros(nb, bs, hkv, d, dtype=dtype)
        pos = torch.arange(n)
        slots = tables[0, pos // bs].long() * bs + pos % bs
        impl.store_kv(
            torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g), kc, vc, slots
        )
        one = torch.tensor([n], dtype=torch.int32)
        start = torch.tensor([0, n], dtype=torch.int32)
        meta = AttentionMetadata(slots, tables, one, start, [n], [0, n], 0, n)
        q = torch.randn(n, h, d, generator=g)
        fns = {"tiled": CpuAttention.prefill, "rows": row_prefill}
        outs = {p: fns[p](impl, q, q, q, kc, vc, meta, d**-0.5) for p in paths}
        best = {p: float("inf") for p in paths}
        for _ in range(args.reps):
            for p in paths:
                t = time.perf_counter()
                fns[p](impl, q, q, q, kc, vc, meta, d**-0.5)
                best[p] = min(best[p], time.perf_counter() - t)
        diff = (outs[paths[0]] - outs[paths[-1]]).abs().max().item()
        res[str(n)] = {f"{p}_ms": round(best[p] * 1e3, 2) for p in paths} | {"max_abs_diff": diff}
        line = "  ".join(f"{p} {best[p] * 1e3:9.2f} ms" for p in paths)
        print(f"  {n:6d} tokens: {line}   max |diff| {diff:.1e}", file=sys.stderr)
    return res


def engine(args: argparse.Namespace, lengths: list[int], paths: list[str]) -> dict[str, Any]:
    """Prompt tokens/s of the offline engine per length and path."""
    from structllm import LLM, SamplingParams

    tiled = CpuAttention.prefill
    kwargs: dict[str, Any] = {"max_model_len": max(lengths) + 8, "attention_backend": "cpu"}
    if args.model:
        kwargs["model"] = args.model
    if args.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    llm = LLM(**kwargs)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    vocab = llm.tokenizer.vocab_size if hasattr(llm.tokenizer, "vocab_size") else 32000
    rng = random.Random(0)
    llm.generate([[rng.randrange(100, vocab) for _ in range(64)]], sp)  # warm up
    best: dict[tuple[int, str], float] = {}
    try:
        for _ in range(args.reps):
            for n in lengths:
                for p in paths:
                    CpuAttention.prefill = tiled if p == "tiled" else row_prefill  # type: ignore[method-assign]
                    prompt = [rng.randrange(100, vocab) for _ in range(n)]
                    t = time.perf_counter()
                    llm.generate([prompt], sp)
                    dt = time.perf_counter() - t
                    best[n, p] = min(best.get((n, p), float("inf")), dt)
    finally:
        CpuAttention.prefill = tiled  # type: ignore[method-assign]
        llm.close()
    res: dict[str, Any] = {}
    for n in lengths:
        res[str(n)] = {f"{p}_tok_s": round(n / best[n, p], 1) for p in paths}
        line = "  ".join(f"{p} {n / best[n, p]:8.1f} tok/s ({best[n, p]:6.2f} s)" for p in paths)
        print(f"  {n:6d} tokens: {line}", file=sys.stderr)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lengths", default="512,2048,8000")
    ap.add_argument("--paths", default="tiled,rows", help="tiled, rows or both (comma-separated)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--attention-only", action="store_true")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    if a.attention_only and a.kv_cache_dtype == "auto":
        a.kv_cache_dtype = "float16"
    module = cpu_ext.load()
    what = "attention only" if a.attention_only else "engine"
    isa = module.isa() if module else "nothing"
    threads = torch.get_num_threads()
    print(f"prefill, {threads} threads, kernel built for {isa}; {what}", file=sys.stderr)
    res = attention_only(a, lengths, paths) if a.attention_only else engine(a, lengths, paths)
    print(json.dumps({"bench": "prefill", "attention_only": a.attention_only, "results": res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
