"""Which slice of the model each tensor-parallel rank holds, and cutting the weights.

Megatron-style: the column-parallel matmuls (``qkv_proj``, ``gate_up_proj``) keep a
slice of their output rows, the row-parallel ones (``o_proj``, ``down_proj``) the
matching slice of their input columns, so a layer needs one all-reduce after each
row-parallel matmul. The embedding and the LM head keep a slice of the vocabulary.
Norms are replicated.

Attention heads are split by KV-head group (the query heads that read one KV head), so
that each rank's attention is ordinary GQA over its own KV heads:

- ``num_kv_heads >= N``: rank ``r`` gets the groups ``[r*Hkv//N, (r+1)*Hkv//N)``. Each
  group lives on exactly one rank. When ``N`` does not divide ``Hkv`` the ranks differ
  by one group (SmolLM2-135M, 9 query / 3 KV heads, on 2 ranks: 1 group on rank 0 and
  2 on rank 1). The KV cache is sized for the largest shard.
- ``num_kv_heads < N``: the KV heads are replicated: ``N / Hkv`` consecutive ranks share
  one KV head (each computes and caches its own copy) and split its group's query heads.
  This needs ``N`` to be a multiple of ``Hkv`` and the group size a multiple of
  ``N / Hkv``; otherwise ``plan_shards`` raises ``ValueError`` naming the numbers.

The MLP's intermediate dimension and the vocabulary are split into contiguous ranges
that differ in length by at most one. A mixture of experts is split the same way inside
every expert (vLLM's tensor parallelism for MoE): each rank holds every expert's slice
of its intermediate dimension (``expert_ffn``) and the whole router, routes every token
as the others do, and its experts' partial sums meet in the layer's one all-reduce.

OLMo 2's q/k norms run over the whole projection, which the ranks hold in slices: each
rank keeps its slice of the norm weights and the layer all-reduces the sums of squares
(``DecoderLayer._norm_qk``: two numbers per token, not the projection).

GGUF block weights (``BlockWeight``) are cut the same way without dequantising: a row
slice is a slice of whole block rows, and a column slice (the row-parallel matmuls'
inputs) is a slice of whole blocks of 32 when its bounds fall on block boundaries
(SmolLM2-135M on 2 ranks: heads of 64 columns, an MLP split at 768). Where they do not,
that one matrix is dequantised and cut as floats, and the load says which. The
k-quants (Q4_K, Q5_K, Q6_K) and IQ4_XS are held as the file's super-blocks and shard at
256 columns. A ``MixedWeight`` (a fused matrix whose parts differ
in type) is cut part by part.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch import Tensor

from structllm.kernels.packed import BlockWeight
from structllm.model.config import ModelConfig

Matrix = Tensor | BlockWeight


def _even_range(n: int, rank: int, world: int) -> range:
    return range(rank * n // world, (rank + 1) * n // world)


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``world_size`` holds (global indices)."""

    rank: int
    world_size: int
    heads: range  # query heads
    kv_heads: range  # the KV heads those query heads read
    ffn: range  # intermediate (MLP) columns
    expert_ffn: range  # each expert's intermediate columns (mixture of experts)
    vocab: range  # vocabulary rows of the embedding and the LM head
    vocab_sizes: tuple[int, ...]  # every rank's vocabulary slice length, in rank order
    shared_ffn: range = range(0)  # a shared expert's intermediate columns (Qwen2-MoE)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def vocab_stride(self) -> int:
        """The longest vocabulary slice of any rank: the width logits are gathered at."""
        return max(self.vocab_sizes)


def plan_shards(cfg: ModelConfig, world_size: int) -> list[ShardPlan]:
    """The plan of every rank, or ``ValueError`` if ``cfg`` cannot be split that way."""
    n, h, hkv = world_size, cfg.num_heads, cfg.num_kv_heads
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {n}")
    if n > h:
        raise ValueError(f"tensor_parallel_size {n} exceeds the model's {h} attention heads")
    if n > 1 and cfg.architecture == "gpt_oss":
        raise ValueError(
            f"tensor_parallel_size {n}: gpt-oss does not run with tensor parallelism yet "
            "(its attention sinks, o_proj and expert biases are not sharded)"
        )
    group = h // hkv
    if n > hkv:
        if n % hkv:
            raise ValueError(
                f"the model's {hkv} KV heads cannot be split over tensor_parallel_size {n}: "
                f"above {hkv}, the size must be a multiple of it (KV heads are then replicated)"
            )
        if group % (n // hkv):
            raise ValueError(
                f"tensor_parallel_size {n} would split each KV head's {group} query heads over "
                f"{n // hkv} ranks, which does not divide evenly"
            )
    expert_ffn = cfg.moe_intermediate_size or cfg.intermediate_size
    shared = cfg.shared_expert_intermediate_size or n
    if n > cfg.intermediate_size or n > cfg.vocab_size or n > expert_ffn or n > shared:
        raise ValueError(f"tensor_parallel_size {n} exceeds the model's MLP or vocabulary size")
    vocab_sizes = tuple(len(_even_range(cfg.vocab_size, r, n)) for r in range(n))
    plans = []
    for r in range(n):
        if n <= hkv:
            kv = _even_range(hkv, r, n)
            heads = range(kv.start * group, kv.stop * group)
        else:
            share = n // hkv  # ranks per KV head
            kv_head = r // share
            per = group // share
            start = kv_head * group + (r % share) * per
            kv, heads = range(kv_head, kv_head + 1), range(start, start + per)
        plans.append(
            ShardPlan(
                rank=r,
                world_size=n,
                heads=heads,
                kv_heads=kv,
                ffn=_even_range(cfg.intermediate_size, r, n),
                expert_ffn=_even_range(expert_ffn, r, n),
                vocab=_even_range(cfg.vocab_size, r, n),
                vocab_sizes=vocab_sizes,
                shared_ffn=_even_range(cfg.shared_expert_intermediate_size, r, n),
            )
        )
    return plans


def _rows(w: Matrix, r: range, width: int = 1) -> Matrix:
    """Rows ``r.start*width .. r.stop*width`` of ``w`` (dim 0); a view of a tensor."""
    a, b = r.start * width, r.stop * width
    if isinstance(w, BlockWeight):
        return w.row_range(a, b)
    return w[a:b]


def _split(w: Matrix, sizes: list[int]) -> list[Matrix]:
    """``w`` cut into consecutive row ranges of ``sizes``."""
    out, start = [], 0
    for n in sizes:
        out.append(_rows(w, range(start, start + n)))
        start += n
    return out


def _cat(parts: list[Matrix]) -> Matrix:
    """Rows of ``parts`` stacked, in a new tensor."""
    if all(isinstance(p, BlockWeight) for p in parts):
        return BlockWeight.cat([p for p in parts if isinstance(p, BlockWeight)])
    return torch.cat([p.dequantize() if isinstance(p, BlockWeight) else p for p in parts])


def _columns(w: Matrix, a: int, b: int) -> Matrix:
    """Columns ``a .. b`` of ``w``, a tensor of its own: whole blocks of a
    ``BlockWeight`` when ``a`` and ``b`` fall on block boundaries (32 columns; the
    k-quants' are their 256-weight super-blocks cut into the kernels' blocks of 32 at
    load), else floats."""
    if isinstance(w, BlockWeight):
        cut = w.columns(a, b)
        if cut is not None:
            return cut
        w = w.dequantize()
    return _own(w[:, a:b])


def _own(view: Matrix) -> Matrix:
    """A contiguous copy of ``view``, so that the full tensor behind it can be freed."""
    if isinstance(view, BlockWeight):
        return view.owned()
    return view.clone(memory_format=torch.contiguous_format)


@overload
def shard_weights(
    weights: dict[str, Tensor], cfg: ModelConfig, plan: ShardPlan
) -> dict[str, Tensor]: ...
@overload
def shard_weights(
    weights: dict[str, Matrix], cfg: ModelConfig, plan: ShardPlan
) -> dict[str, Matrix]: ...
def shard_weights(
    weights: Mapping[str, Matrix], cfg: ModelConfig, plan: ShardPlan
) -> dict[str, Any]:
    """``weights`` (full, under our fused names; tensors or GGUF blocks) -> this rank's
    slices, each of its own (not a view of the full one)."""
    d, h, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    out: dict[str, Matrix] = {}
    dequantised: list[str] = []  # block matrices that had to become floats
    for name, w in weights.items():
        kind = name.rsplit(".", 1)[-1]
        expert = ".moe.experts." in name
        ffn = (
            (cfg.moe_intermediate_size or cfg.intermediate_size)
            if expert
            else cfg.intermediate_size
        )
        cols = plan.expert_ffn if expert else plan.ffn
        if ".moe.shared." in name:  # the shared expert: its own width
            ffn, cols = cfg.shared_expert_intermediate_size, plan.shared_ffn
        part: Matrix
        per_head = cfg.qk_norm in ("full", "layer_heads")  # q/k norm weights [H*D]
        if kind == "q_norm" and per_head:  # this rank's heads
            part = _own(_rows(w, plan.heads, d))
        elif kind == "k_norm" and per_head:
            part = _own(_rows(w, plan.kv_heads, d))
        elif kind in ("qkv_proj", "qkv_bias"):
            # rows (and bias entries): [q heads (H*D) | k heads (Hkv*D) | v heads (Hkv*D)]
            q, k, v = _split(w, [h * d, hkv * d, hkv * d])
            part = _cat(
                [_rows(q, plan.heads, d), _rows(k, plan.kv_heads, d), _rows(v, plan.kv_heads, d)]
            )
        elif kind == "o_proj":  # [hidden, H*D]: input columns of this rank's heads
            part = _columns(w, plan.heads.start * d, plan.heads.stop * d)
        elif kind == "gate_up_proj" or (kind == "up_bias" and cfg.mlp_gated):
            gate, up = _split(w, [ffn, ffn])  # rows: [gate (I) | up (I)]
            part = _cat([_rows(gate, cols), _rows(up, cols)])
        elif kind in ("up_proj", "up_bias"):  # an ungated MLP's first matrix, [I, hidden]
            part = _own(_rows(w, cols))
        elif kind == "down_proj":  # [hidden, I]
            part = _columns(w, cols.start, cols.stop)
        elif kind in ("embed_tokens", "lm_head", "lm_head_bias"):  # [V, hidden], [V]
            part = _own(_rows(w, plan.vocab))
        else:  # norms (per head) and their biases, routers, output biases: replicated
            part = _own(w)
        if isinstance(w, BlockWeight) and not isinstance(part, BlockWeight):
            dequantised.append(name)
        out[name] = part
    if dequantised:
        sys.stderr.write(
            f"structllm: tensor parallelism rank {plan.rank}: {len(dequantised)} block matrices "
            f"dequantised to float32, their shard's columns not on blocks of 32: "
            f"{', '.join(dequantised[:4])}{' ...' if len(dequantised) > 4 else ''}\n"
        )
    return out
