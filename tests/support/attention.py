"""Paged K/V set-ups for the attention kernels' tests."""

from __future__ import annotations

from typing import Any

import torch

from structllm.kernels import reference


def paged_setup(
    lens: list[int], hkv: int, d: int, bs: int, nb: int = 64, seed: int = 0, impl: Any = None
):  # type: ignore[no-untyped-def]
    """Random K/V for sequences of ``lens`` tokens, scattered over shuffled blocks and
    stored by ``impl`` (a backend with its own K layout) or the reference."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(
        impl.k_cache_shape(nb, bs, hkv, d) if impl is not None else (nb, bs, hkv, d)
    )
    v_cache = torch.zeros(nb, bs, hkv, d)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, dense = [], []
    for n in lens:
        nblk = -(-n // bs)
        blocks, perm = perm[:nblk], perm[nblk:]
        k = torch.randn(n, hkv, d, generator=g)
        v = torch.randn(n, hkv, d, generator=g)
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])
        (impl or reference).store_kv(k, v, k_cache, v_cache, slots)
        tables.append(blocks)
        dense.append((k, v))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, bt, dense
