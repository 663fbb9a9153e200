"""Attention kernels on a GPU: Triton paged attention vs PyTorch SDPA, same run.

    python bench/gpu_attention.py                      # Llama-3-8B heads: H=32, Hkv=8, D=128, bf16
    python bench/gpu_attention.py --heads 9 --kv-heads 3 --head-dim 64   # the default model's

Decode (one query token per sequence, every sequence ``ctx`` tokens long) at batch
1/32/128 x context 512/4k/32k: achieved bandwidth = bytes of K/V and queries, each read
once, divided by the kernel time. Prefill (causal, fresh prompts and one chunk after a
cached prefix): achieved TFLOP/s = 4 * H * D * (query, key) pairs under the mask / time.

Baselines, on the same data: ``torch.nn.functional.scaled_dot_product_attention`` over
K/V already gathered into contiguous ``[B, Hkv, L, D]`` tensors ("sdpa", the gather not
timed), and the same with the gather from the paged cache timed ("gather+sdpa"). The
reference figure for bandwidth is a device-to-device copy (read + write bytes / time).

Targets (an H200): decode >= 70% of copy bandwidth for batch >= 32 and context >= 4k,
and faster than the sdpa baseline everywhere. Prints a table on stderr and one JSON
line on stdout. Times are medians of ``triton.testing.do_bench`` (L2 flushed between
runs, so small cases are not served from cache).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def bench_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """GB/s of a device-to-device copy, counting the bytes read and the bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def paged_kv(
    b: int, ctx: int, hkv: int, d: int, bs: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches holding ``b`` sequences of ``ctx`` tokens in randomly permuted blocks, and
    their block tables ``[b, ctx / bs]``."""
    nblk = -(-ctx // bs)
    nb = b * nblk
    k_cache = torch.randn(nb, bs, hkv, d, dtype=dtype, device="cuda", generator=gen)
    v_cache = torch.randn(nb, bs, hkv, d, dtype=dtype, device="cuda", generator=gen)
    perm = torch.randperm(nb, device="cuda", generator=gen).to(torch.int32)
    return k_cache, v_cache, perm.view(b, nblk)


def gather(cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    """``[B, Hkv, ctx, D]`` contiguous, SDPA's preferred layout."""
    b = tables.shape[0]
    flat = cache.index_select(0, tables.reshape(-1).long())  # [B * nblk, BS, Hkv, D]
    return flat.view(b, -1, *cache.shape[2:])[:, :ctx].transpose(1, 2).contiguous()


def decode_case(args: argparse.Namespace, b: int, ctx: int, gen: torch.Generator) -> dict[str, Any]:
    from structllm.kernels.attention import AttentionMetadata
    from structllm.kernels.triton_attention import TritonAttention

    h, hkv, d, bs, dtype = (
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.block_size,
        args.torch_dtype,
    )
    k_cache, v_cache, tables = paged_kv(b, ctx, hkv, d, bs, dtype, gen)
    q = torch.randn(b, h, d, dtype=dtype, device="cuda", generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(b, dtype=torch.long, device="cuda"),
        block_tables=tables,
        seq_lens=torch.full((b,), ctx, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device="cuda"),
        seq_lens_list=[ctx] * b,
        query_start_list=list(range(b + 1)),
        num_decodes=b,
        max_seq_len=ctx,
    )
    scale = d**-0.5
    impl = TritonAttention()
    out = impl.decode(q, k_cache, v_cache, meta, scale)
    t_triton = bench_ms(lambda: impl.decode(q, k_cache, v_cache, meta, scale))

    qs = q.unsqueeze(2)  # [B, H, 1, D]
    k, v = gather(k_cache, tables, ctx), gather(v_cache, tables, ctx)
    want = F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True).squeeze(2)
    err = (out.float() - want.float()).abs().max().item()
    t_sdpa = bench_ms(
        lambda: F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True)
    )

    def gathered() -> torch.Tensor:
        kg, vg = gather(k_cache, tables, ctx), gather(v_cache, tables, ctx)
        return F.scaled_dot_product_attention(qs, kg, vg, scale=scale, enable_gqa=True)

    t_gather = bench_ms(gathered)
    nbytes = 2 * b * ctx * hkv * d * dtype.itemsize + q.numel() * dtype.itemsize
    return {
        "batch": b,
        "ctx": ctx,
        "triton_ms": t_triton,
        "sdpa_ms": t_sdpa,
        "gather_sdpa_ms": t_gather,
        "triton_GBps": nbytes / t_triton / 1e6,
        "sdpa_GBps": nbytes / t_sdpa / 1e6,
        "gather_sdpa_GBps": nbytes / t_gather / 1e6,
        "max_abs_err": err,
    }


def prefill_case(
    args: argparse.Namespace, b: int, q_len: int, cached: int, gen: torch.Generator
) -> dict[str, Any]:
    from torch.nn.attention.bias import causal_lower_right

    from structllm.kernels.attention import AttentionMetadata
    from structllm.kernels.triton_attention import TritonAttention

    h, hkv, d, bs, dtype = (
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.block_size,
        args.torch_dtype,
    )
    ctx = cached + q_len
    k_cache, v_cache, tables = paged_kv(b, ctx, hkv, d, bs, dtype, gen)
    q = torch.randn(b * q_len, h, d, dtype=dtype, device="cuda", generator=gen)
    starts = [i * q_len for i in range(b + 1)]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(b * q_len, dtype=torch.long, device="cuda"),
        block_tables=tables,
        seq_lens=torch.full((b,), ctx, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens_list=[ctx] * b,
        query_start_list=starts,
        num_decodes=0,
        max_seq_len=ctx,
    )
    scale = d**-0.5
    impl = TritonAttention()
    out = impl.prefill(q, q, q, k_cache, v_cache, meta, scale)  # k, v are read from the cache
    t_triton = bench_ms(lambda: impl.prefill(q, q, q, k_cache, v_cache, meta, scale))

    qs = q.view(b, q_len, h, d).transpose(1, 2)  # [B, H, Q, D]
    k, v = gather(k_cache, tables, ctx), gather(v_cache, tables, ctx)

    def sdpa(kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        if cached == 0:
            return F.scaled_dot_product_attention(
                qs, kk, vv, is_causal=True, scale=scale, enable_gqa=True
            )
        mask = causal_lower_right(q_len, ctx)  # queries are the last q_len positions
        return F.scaled_dot_product_attention(
            qs, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True
        )

    want = sdpa(k, v).transpose(1, 2).reshape(b * q_len, h, d)
    err = (out.float() - want.float()).abs().max().item()
    t_sdpa = bench_ms(lambda: sdpa(k, v))
    t_gather = bench_ms(lambda: sdpa(gather(k_cache, tables, ctx), gather(v_cache, tables, ctx)))
    pairs = b * (q_len * cached + q_len * (q_len + 1) // 2)  # (query, key) pairs under the mask
    flops = 4 * h * d * pairs  # QK^T and PV, 2 flops per multiply-add
    return {
        "batch": b,
        "q_len": q_len,
        "cached": cached,
        "triton_ms": t_triton,
        "sdpa_ms": t_sdpa,
        "gather_sdpa_ms": t_gather,
        "triton_TFLOPs": flops / t_triton / 1e9,
        "sdpa_TFLOPs": flops / t_sdpa / 1e9,
        "gather_sdpa_TFLOPs": flops / t_gather / 1e9,
        "max_abs_err": err,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 32768])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench/gpu_attention.py needs CUDA: no CUDA device is visible to this torch build",
            file=sys.stderr,
        )
        return 2
    args.torch_dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)

    copy = copy_bandwidth()
    decode, prefill = [], []
    for b in args.batches:
        for c in args.contexts:
            decode.append(decode_case(args, b, c, gen))
            torch.cuda.empty_cache()  # the last case's tensors were freed on return
    for b, q, cached in [(1, 4096, 0), (8, 1024, 0), (1, 16384, 0), (1, 2048, 6144)]:
        prefill.append(prefill_case(args, b, q, cached, gen))
        torch.cuda.empty_cache()
    for r in decode:
        r["triton_frac_of_copy"] = r["triton_GBps"] / copy
    big = [r for r in decode if r["batch"] >= 32 and r["ctx"] >= 4096]
    result = {
        "device": torch.cuda.get_device_name(),
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "block_size": args.block_size, "dtype": args.dtype},
        "copy_GBps": copy,
        "decode": decode,
        "prefill": prefill,
        "decode_min_frac_of_copy_large": min((r["triton_frac_of_copy"] for r in big), default=None),
        "decode_target_met": all(r["triton_frac_of_copy"] >= 0.7 for r in big) if big else None,
        "faster_than_sdpa_everywhere": all(r["triton_ms"] < r["sdpa_ms"] for r in decode + prefill),
    }  # fmt: skip

    err = sys.stderr
    print(f"{result['device']}  {result['shape']}  copy {copy:,.0f} GB/s", file=err)
    print(
        f"{'decode':>16}{'triton GB/s':>13}{'% copy':>8}{'sdpa GB/s':>11}"
        f"{'gather+sdpa':>13}{'vs sdpa':>9}{'err':>9}",
        file=err,
    )
    for r in decode:
        label = f"B={r['batch']} ctx={r['ctx']}"
        print(
            f"{label:>16}{r['triton_GBps']:>13,.0f}{100 * r['triton_frac_of_copy']:>7.0f}%"
            f"{r['sdpa_GBps']:>11,.0f}{r['gather_sdpa_GBps']:>13,.0f}"
            f"{r['sdpa_ms'] / r['triton_ms']:>8.2f}x{r['max_abs_err']:>9.1e}",
            file=err,
        )  # fmt: skip
    print(
        f"{'prefill':>22}{'triton TFLOP/s':>16}{'sdpa':>8}"
        f"{'gather+sdpa':>13}{'vs sdpa':>9}{'err':>9}",
        file=err,
    )
    for r in prefill:
        label = f"B={r['batch']} q={r['q_len']} cached={r['cached']}"
        print(
            f"{label:>22}{r['triton_TFLOPs']:>16.1f}{r['sdpa_TFLOPs']:>8.1f}{r['gather_sdpa_TFLOPs']:>13.1f}"
            f"{r['sdpa_ms'] / r['triton_ms']:>8.2f}x{r['max_abs_err']:>9.1e}",
            file=err,
        )  # fmt: skip
    print(
        f"decode >= 70% of copy (B>=32, ctx>=4k): {result['decode_target_met']}; "
        f"faster than sdpa everywhere: {result['faster_than_sdpa_everywhere']}",
        file=err,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
