"""Paged decode attention on the CPU: the C++ kernel against the torch reference.

One decode step of B sequences with L tokens of context each, in SmolLM2-135M's
attention shape by default (9 query heads, 3 KV heads, head size 64, blocks of 16),
blocks shuffled over the pool as a busy cache leaves them. Prints milliseconds per call
for the kernel and the reference (gather + batched matmuls) run here on the same
cache, the ratio, and the K/V read rate against a plain tensor copy of the same bytes
(a memory-bandwidth yardstick), then one JSON line.

    python bench/cpu_attention.py [--batch 64] [--context 208]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch

from structllm.kernels import cpu_ext
from structllm.kernels.attention import AttentionMetadata, CpuAttention, TorchAttention


def bench_ms(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def paged_step(impl: CpuAttention | TorchAttention, b: int, ctx: int, h: int, hkv: int, d: int, bs: int,
               g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A cache holding ``b`` sequences of ``ctx`` tokens in shuffled blocks, stored through
    ``impl`` (each backend keeps K in its own layout), and one query token per sequence."""
    per_seq = -(-ctx // bs)
    nb = b * per_seq
    perm = torch.randperm(nb, generator=g)
    tables = perm.view(b, per_seq).to(torch.int32)  # [B, MB]
    k_cache = torch.zeros(impl.k_cache_shape(nb, bs, hkv, d) if isinstance(impl, CpuAttention) else (nb, bs, hkv, d))
    v_cache = torch.zeros(nb, bs, hkv, d)
    pos = torch.arange(ctx)
    slots = (tables[:, pos // bs].long() * bs + pos % bs).flatten()  # [B * ctx]
    k = torch.randn(b * ctx, hkv, d, generator=g)
    v = torch.randn(b * ctx, hkv, d, generator=g)
    impl.store_kv(k, v, k_cache, v_cache, slots)
    meta = AttentionMetadata(
        slot_mapping=slots.view(b, ctx)[:, -1],
        block_tables=tables,
        seq_lens=torch.full((b,), ctx, dtype=torch.int32),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32),
        seq_lens_list=[ctx] * b,
        query_start_list=list(range(b + 1)),
        num_decodes=b,
        max_seq_len=ctx,
    )
    q = torch.randn(b, h, d, generator=g)
    return q, k_cache, v_cache, meta


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=208, help="tokens of context per sequence (128 + 80 generated)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    module = cpu_ext.load()
    if module is None:
        print("the C++ kernel did not build here (see the warning above)", file=sys.stderr)
        return 2
    shape = (a.batch, a.context, a.heads, a.kv_heads, a.head_dim, a.block_size)
    scale = a.head_dim**-0.5
    kernel, ref = CpuAttention(module), TorchAttention()
    q, kc, vc, meta = paged_step(kernel, *shape, torch.Generator().manual_seed(0))
    q_ref, kc_ref, vc_ref, meta_ref = paged_step(ref, *shape, torch.Generator().manual_seed(0))
    out, want = kernel.decode(q, kc, vc, meta, scale), ref.decode(q_ref, kc_ref, vc_ref, meta_ref, scale)
    err = (out - want).abs().max().item()

    t_kernel = bench_ms(lambda: kernel.decode(q, kc, vc, meta, scale), a.reps)
    t_ref = bench_ms(lambda: ref.decode(q_ref, kc_ref, vc_ref, meta_ref, scale), a.reps)
    kv_bytes = 2 * a.batch * a.context * a.kv_heads * a.head_dim * 4  # what one step must read
    src = torch.randn(kv_bytes // 4)
    dst = torch.empty_like(src)
    t_copy = bench_ms(lambda: dst.copy_(src), a.reps)  # reads and writes kv_bytes
    res = {
        "bench": "cpu_attention", "batch": a.batch, "context": a.context, "threads": torch.get_num_threads(),
        "kernel_ms": round(t_kernel, 3), "reference_ms": round(t_ref, 3), "speedup": round(t_ref / t_kernel, 2),
        "kernel_read_gb_s": round(kv_bytes / t_kernel / 1e6, 1), "copy_gb_s": round(2 * kv_bytes / t_copy / 1e6, 1),
        "max_abs_err": err,
    }
    print(f"decode B={a.batch} L={a.context} (H={a.heads}, Hkv={a.kv_heads}, D={a.head_dim}, BS={a.block_size}), "
          f"{kv_bytes / 1e6:.1f} MB of K/V, {res['threads']} threads", file=sys.stderr)
    print(f"  C++ kernel      {t_kernel:8.3f} ms  ({res['kernel_read_gb_s']} GB/s read; copy runs at "
          f"{res['copy_gb_s']} GB/s)", file=sys.stderr)
    print(f"  torch reference {t_ref:8.3f} ms  -> kernel {res['speedup']}x faster, max |diff| {err:.1e}",
          file=sys.stderr)
    print(json.dumps(res))
    return 0 if err < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
