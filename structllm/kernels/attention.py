"""The attention step of one layer over the paged KV cache, with a choice of kernels.

A step's flat batch puts the decode sequences first (one token each) and the prefill
chunks after them, so decode attention runs as one batched call over the first
``num_decodes`` rows and prefill attention over the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from structllm.kernels import reference


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where this step's tokens go and what they attend to (see ``reference`` for the
    layout). Tensors live on the model's device; the ``*_list`` twins are host copies
    for loops that would otherwise synchronise."""

    slot_mapping: Tensor  # [T] int64
    block_tables: Tensor  # [B, MB] int32
    seq_lens: Tensor  # [B] int32, context after this step
    query_start_loc: Tensor  # [B+1] int32
    seq_lens_list: list[int]
    query_start_list: list[int]
    num_decodes: int  # sequences 0..num_decodes-1 each have exactly one query token
    max_seq_len: int
    # [B] hybrid models: each sequence's recurrent-state slot (model.recurrent)
    state_slots: list[int] = field(default_factory=list)
    # hybrid models' saved states: see ``protocol.StepInput.state_loads``/``state_saves``
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)
    # [T] int64, or None: keys past its own position each row also sees (Gemma 3's image
    # tokens attend to the rest of their image; 0 for every other row), and the
    # sequences (batch indices, all prefill chunks) that have such rows (the reference
    # and the C++ kernel take ahead; others leave those to the reference,
    # ``prefill_with_ahead``)
    ahead: Tensor | None = None
    ahead_seqs: frozenset[int] = frozenset()
    # a bidirectional model's step (engine.pooling): what its windowed layers attend
    # with, the same rows seeing at most window - 1 keys ahead; None: as the others
    windowed: AttentionMetadata | None = None


class AttentionImpl(Protocol):
    """What a kernel family provides (``reference`` is one): three operations, the K
    cache layout it reads, and whether its decode can be captured in a CUDA graph.

    Every attention takes the layer's softmax ``scale``, its ``window`` (a query sees
    only the last ``window`` keys up to itself, its own included; 0: all of them) and
    its ``softcap`` (scores become ``softcap * tanh(score / softcap)`` before the
    softmax, Gemma 2's; 0: none) and its ``sinks`` (``[H]`` float32, gpt-oss's: one more
    logit per query head in each row's softmax denominator, weighing no value; None:
    none) and its ``chunk`` (chunked local attention, Llama 4's: a query at position
    ``p`` sees only the keys from ``floor(p / chunk) * chunk`` up to itself; 0: none;
    not a window: the first query of a chunk sees itself alone). The cache holds every
    position of every layer; a window or chunk only limits what is read.

    ``meta.ahead`` (images whose tokens attend to each other both ways): a prefill row
    also sees the next ``ahead[row]`` keys after its own position (this step's, stored
    before attending), within the window's lower bound as before. The reference and
    the C++ kernel implement it; ``prefill_with_ahead`` computes the chunks that have
    such rows through the reference for the others (Triton), whose other chunks of
    the step keep their bit-exact rows."""

    name: str
    supports_cuda_graphs: bool

    def k_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]: ...

    def store_kv(
        self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
    ) -> None: ...

    def decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: Tensor | None = None,
        chunk: int = 0,
    ) -> Tensor: ...

    def prefill(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: Tensor | None = None,
        chunk: int = 0,
    ) -> Tensor: ...


class TorchAttention:
    """The reference operations; what the engine uses on CPU."""

    name = "torch"
    supports_cuda_graphs = False
    k_transposed = False  # K cache layout: [NB, BS, Hkv, D], or [NB, Hkv, D, BS] if True

    @staticmethod
    def k_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def store_kv(
        self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
    ) -> None:
        reference.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: Tensor | None = None,
        chunk: int = 0,
    ) -> Tensor:
        nd = meta.num_decodes
        max_len = max(meta.seq_lens_list[:nd])
        return reference.decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables[:nd],
            meta.seq_lens[:nd],
            scale,
            max_len,
            window,
            softcap,
            sinks,
            chunk,
        )

    def prefill(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: Tensor | None = None,
        chunk: int = 0,
    ) -> Tensor:
        nd = meta.num_decodes
        starts = [s - nd for s in meta.query_start_list[nd:]]  # rows of q, k, v start at token nd
        ahead = meta.ahead[nd:] if meta.ahead is not None else None
        return reference.prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables[nd:],
            starts,
            meta.seq_lens_list[nd:],
            scale,
            k,
            v,
            k_transposed=self.k_transposed,
            window=window,
            softcap=softcap,
            ahead=ahead,
            ahead_seqs=frozenset(b - nd for b in meta.ahead_seqs),
            sinks=sinks,
            chunk=chunk,
        )


class CpuAttention(TorchAttention):
    """Decode through the C++ kernel (``cpu_attention.cpp``: K/V read in place, on the
    kernels' thread pool). Its K cache is block-transposed, ``[NB, Hkv, D, BS]``, so that
    a block's scores are plain vector FMAs; V keeps the reference layout. Stores are the
    reference operations adapted to that layout; prefill rows go through the tiled
    prefill kernel of the same file (``prefill``). CPU, float32 queries; the cache
    float32 or float16 (``--kv-cache-dtype``: converted on the store, widened to float32
    in registers by the kernel)."""

    name = "cpu"
    k_transposed = True
    sees_ahead = True  # its prefill takes meta.ahead (see prefill_with_ahead)

    def __init__(self, module: Any) -> None:
        self.module = module  # its attention_ops: model/decode_plan.py runs its decode
        self._decode = module.paged_decode
        self._prefill = module.paged_prefill
        # prefill's block tables, row starts, contexts and rows' keys ahead (or None),
        # for the step whose metadata this is: every layer of a step calls prefill with
        # the same ``meta``
        # (two: a bidirectional model's windowed layers have their own, meta.windowed)
        self._rows: list[tuple[AttentionMetadata, Tensor, Tensor, Tensor, Tensor | None]] = []

    @staticmethod
    def supports(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """The shapes the kernel was written for (see ``cpu_attention.cpp``)."""
        return block_size in (16, 32, 64) and num_heads // num_kv_heads <= 16 and head_dim <= 512

    @staticmethod
    def k_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, head_dim, block_size)

    def store_kv(
        self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
    ) -> None:
        reference.store_k_transposed(k, k_cache, slot_mapping)
        nb, bs, hkv, d = v_cache.shape
        v_cache.view(nb * bs, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def prefill(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: Tensor | None = None,
        chunk: int = 0,
    ) -> Tensor:
        """Prefill rows through the tiled kernel (``paged_prefill``): row ``r`` of a
        sequence's chunk attends to its first ``ctx - q_len + r + 1`` cached tokens. This
        step's K/V must already be in the cache (``attend``'s contract); ``k, v`` are not
        read.

        Tiles of query rows walk the KV blocks together, so a long prompt's K/V cross
        from memory once per tile rather than once per row (the decode kernel row by row
        re-read each row's whole context: 2048 to 8000 tokens lost 3.6x of prompt
        tokens/s). Every row still runs its blocks in the decode kernel's order through
        its per-block code, so a token's attention does not depend on how its prompt was
        cut into steps or whether it came as a prefill or a decode row, bit for bit; and
        the kernel runs on the kernels' pool, not torch's OpenMP one (SDPA there held the
        pool's threads off the cores, and the matmuls after it slowed down)."""
        rows = next((r for r in self._rows if r[0] is meta), None)
        if rows is None:
            rows = (meta, *self._prefill_rows(meta))
            self._rows = [rows, *self._rows[:1]]
        _, tables, starts, ctxs, ahead = rows
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # the kernel wants heads adjacent
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype)
        self._prefill(
            out,
            q,
            k_cache,
            v_cache,
            tables,
            starts,
            ctxs,
            scale,
            window,
            softcap,
            ahead,
            sinks,
            chunk,
        )
        return out

    @staticmethod
    def _prefill_rows(meta: AttentionMetadata) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """The prefill sequences of ``meta``: ``[Bp, MB]`` block tables (contiguous),
        ``[Bp + 1]`` int32 row starts (from the first prefill row), ``[Bp]`` int32
        contexts after this step, and the rows' ``[Tp]`` int32 keys ahead (or None)."""
        nd = meta.num_decodes
        first = meta.query_start_list[nd]
        starts = [s - first for s in meta.query_start_list[nd:]]
        bp = len(starts) - 1
        ahead = None
        if meta.ahead is not None:
            ahead = meta.ahead[first:].to(torch.int32).contiguous()
        return (
            meta.block_tables[nd : nd + bp].contiguous(),
            torch.tensor(starts, dtype=torch.int32),
            torch.tensor(meta.seq_lens_list[nd : nd + bp], dtype=torch.int32),
            ahead,
        )

    def decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: Tensor | None = None,
        chunk: int = 0,
    ) -> Tensor:
        out = torch.empty(q.shape, dtype=q.dtype)  # q: the num_decodes decode rows
        tables, lens = meta.block_tables, meta.seq_lens
        self._decode(out, q, k_cache, v_cache, tables, lens, scale, window, softcap, sinks, chunk)
        return out

    def decode_rows(
        self,
        qkv: Tensor,
        num_heads: int,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        out: Tensor | None = None,
        sinks: Tensor | None = None,
        chunk: int = 0,
    ) -> Tensor:
        """``decode`` of a decode-only step straight from the fused projection's rows
        ``qkv: [T, H + 2 Hkv, D]`` (its K/V already stored): the kernel reads the first
        ``num_heads`` heads of each row as the queries and writes ``[T, H * D]``, the
        ``o_proj`` input, so no slice or reshape is dispatched (each costs microseconds,
        30 times a step); into ``out`` when given (one buffer for a step's layers)."""
        if out is None:
            out = torch.empty((qkv.shape[0], num_heads * qkv.shape[2]), dtype=qkv.dtype)
        tables, lens = meta.block_tables, meta.seq_lens
        self._decode(out, qkv, k_cache, v_cache, tables, lens, scale, window, softcap, sinks, chunk)
        return out


def attention(
    impl: AttentionImpl,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    chunk: int = 0,
) -> Tensor:
    """Store this step's ``k, v: [T, Hkv, D]`` in the cache, then attend with
    ``q: [T, H, D]``; returns ``[T, H, D]``. ``window``, ``softcap``, ``sinks``,
    ``chunk``: see ``AttentionImpl``."""
    impl.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return attend(impl, q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks, chunk)


def prefill_with_ahead(
    impl: AttentionImpl,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    chunk: int = 0,
) -> Tensor:
    """``impl.prefill``, which the reference and the C++ kernel (``sees_ahead``) run with
    rows that see keys ahead (``meta.ahead``) themselves; with another backend (Triton),
    the sequences holding such rows (``meta.ahead_seqs``) are computed again through the
    reference path, in ``impl``'s K cache layout, over the kernel's causal rows: every
    other sequence of the step keeps the kernel's rows bit for bit (a prompt's attention
    does not depend on what shared its step)."""
    if meta.ahead is None or type(impl) is TorchAttention or getattr(impl, "sees_ahead", False):
        return impl.prefill(q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks, chunk)
    out = impl.prefill(q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks, chunk)
    nd, first = meta.num_decodes, meta.query_start_list[meta.num_decodes]
    transposed = bool(getattr(impl, "k_transposed", False))
    for b in sorted(meta.ahead_seqs):
        rows = slice(meta.query_start_list[b] - first, meta.query_start_list[b + 1] - first)
        n = rows.stop - rows.start
        out[rows] = reference.prefill_attention(
            q[rows],
            k_cache,
            v_cache,
            meta.block_tables[b : b + 1],
            [0, n],
            [meta.seq_lens_list[b]],
            scale,
            k[rows],
            v[rows],
            k_transposed=transposed,
            window=window,
            softcap=softcap,
            ahead=meta.ahead[meta.query_start_list[b] : meta.query_start_list[b + 1]],
            ahead_seqs=frozenset({0}),
            sinks=sinks,
            chunk=chunk,
        )
    assert nd <= min(meta.ahead_seqs, default=nd), "decode rows never see ahead"
    return out


def attend(
    impl: AttentionImpl,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    chunk: int = 0,
) -> Tensor:
    """``attention`` once this step's K/V are in the cache (prefill reads ``k, v`` too)."""
    if window and meta.windowed is not None:
        meta = meta.windowed
    nd = meta.num_decodes
    if nd == q.shape[0]:
        return impl.decode(q, k_cache, v_cache, meta, scale, window, softcap, sinks, chunk)
    if nd == 0:
        return prefill_with_ahead(
            impl, q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks, chunk
        )
    out = torch.empty_like(q)
    out[:nd] = impl.decode(q[:nd], k_cache, v_cache, meta, scale, window, softcap, sinks, chunk)
    pre = prefill_with_ahead(
        impl, q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, scale, window, softcap, sinks, chunk
    )
    out[nd:] = pre
    return out
