# mypy: allow-untyped-defs
"""Triton kernels for attention over the paged KV cache (host wrappers: ``triton_attention``).

Layouts are those of ``reference`` (T tokens, B sequences, H query heads, Hkv KV heads,
G = H // Hkv query heads per KV head, D head size, BS slots per cache block):

- ``k_cache``, ``v_cache``: ``[NB, BS, Hkv, D]``; slot ``s`` lives at ``[s // BS, s % BS]``.
- ``block_tables``: ``[B, MB]`` int32, ``seq_lens``: ``[B]`` int32 (context after the step).

The cache's dtype may differ from the queries' (``--kv-cache-dtype``): the store
converts to the cache's, the attention kernels convert each loaded tile to the query's.

Every kernel reads K/V straight out of the cache through the block table: a tile of
``BLOCK_N`` consecutive positions ``n`` is gathered as ``block_table[n // BS]`` and
``n % BS``, so the tile size is independent of the block size (any power of two works,
smaller or larger than the tile) and no contiguous copy of a context is ever made.

Softmax runs online (running max ``m``, running sum ``l``, unnormalised accumulator
``acc``) in float32 whatever the input dtype, and in base 2: scores are multiplied by
``scale * log2(e)`` once, so each exponential is a single ``exp2``.

``tl.dot`` needs every dimension to be at least 16, which is why the decode kernel pads
the G query heads of a KV head to ``BLOCK_G >= 16`` rows (masked on load and store).

The jit functions' parameters cannot carry Python type annotations (Triton reads them
as specialisation hints), hence the ``allow-untyped-defs`` at the top of this file.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    k_ptr,  # [T, Hkv, D], last dim contiguous
    v_ptr,  # [T, Hkv, D], last dim contiguous
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,  # [NB, BS, Hkv, D]
    slot_ptr,  # [T] int64; -1 = padding (a CUDA-graph batch row), skip
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides: block, slot in block, head (shared by k_cache and v_cache)
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= Hkv (tl.arange needs powers of two)
    BLOCK_D: tl.constexpr,  # next power of two >= D
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token: all of its KV heads at once, a [BLOCK_H, BLOCK_D] tile.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # The slot per head row, as a vector: Triton's interpreter mis-types the mask when a
    # scalar comparison is broadcast into it.
    slots = slot + tl.zeros([BLOCK_H], dtype=tl.int64)
    mask = ((h < NUM_KV_HEADS) & (slots >= 0))[:, None] & (d[None, :] < HEAD_DIM)
    # For slot -1 every lane is masked off, so the (meaningless) address is never used.
    dst = (
        (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_cs
        + h[:, None] * stride_ch
        + d[None, :]
    )
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_tile_offsets(
    block_table_row_ptr,  # this sequence's row of block_tables
    n,  # [BLOCK_N] token positions
    n_mask,  # [BLOCK_N] positions that exist (< context length)
    kv_head,
    d,  # [BLOCK_D]
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
):
    """Element offsets ``[BLOCK_N, BLOCK_D]`` of positions ``n`` of one KV head in the cache."""
    # Masked lanes read block 0 instead of running off the end of the block-table row.
    block = tl.load(block_table_row_ptr + n // BLOCK_SIZE, mask=n_mask, other=0)
    # int64: a large cache has more than 2**31 elements, and block * stride_cb overflows int32.
    row = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    return row[:, None] + d[None, :]


@triton.jit
def _soft_cap(s, c):
    """``c * tanh(s / c)``, tanh as ``2 / (1 + exp(-2x)) - 1`` (saturates to +-1)."""
    return c * (2.0 / (1.0 + tl.exp(-2.0 * s / c)) - 1.0)


@triton.jit
def decode_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, MB] int32
    seq_lens_ptr,  # [B] int32; 0 = padding row, gives a zero output
    out_ptr,  # [B, H, D], written only when NUM_SPLITS == 1
    part_m_ptr,  # [B, H, NUM_SPLITS] f32: running max (log2 units) of each split
    part_l_ptr,  # [B, H, NUM_SPLITS] f32: softmax denominator of each split
    part_acc_ptr,  # [B, H, NUM_SPLITS, D] f32: unnormalised output of each split
    sinks_ptr,  # [H] f32 sink logits * log2(e), read when SINKS (the reduce's, when split)
    qk_scale,  # softmax scale * log2(e)
    window,  # keys a query sees (its last ones), used when WINDOWED
    softcap,  # soft-cap * log2(e), used when SOFTCAP: s -> c * tanh(s / c) in log2 units
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,  # G = H // Hkv, need not be a power of two
    BLOCK_G: tl.constexpr,  # max(16, next power of two >= G)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # positions per tile
    NUM_SPLITS: tl.constexpr,
    # "ieee" for float32 inputs (no TF32 rounding), else "tf32" (unused for 16-bit)
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    SINKS: tl.constexpr = False,
):
    # Grid (B, Hkv, NUM_SPLITS). Flash-decoding: the context of a sequence is cut into
    # NUM_SPLITS contiguous runs of whole tiles so that even one long sequence spreads
    # over many SMs; each program handles one run for the G query heads sharing a KV
    # head, so every K/V tile is read from memory once for the whole group.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + b)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g  # [BLOCK_G] query heads of this KV head (GQA: adjacent)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    # The split's run of tiles is derived from this sequence's own length, so the grid
    # does not depend on the lengths (a CUDA graph can be replayed with new ones) and a
    # short sequence simply leaves its later splits empty.
    # With a window the run starts at the tile of the first visible key.
    first = 0
    if WINDOWED:
        first = tl.maximum(seq_len - window, 0)
    base = first // BLOCK_N * BLOCK_N
    num_tiles = tl.cdiv(seq_len - base, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    lo = base + split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < seq_len
        offs = _kv_tile_offsets(
            bt_row, n, n_mask, kv_head, d, stride_cb, stride_cs, stride_ch, BLOCK_SIZE
        )
        kv_mask = n_mask[:, None] & d_mask[None, :]
        # A cache in another dtype (--kv-cache-dtype) is converted to the query's in
        # registers, so tl.dot sees equal types: float16 K/V with float32 queries widen.
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        if WINDOWED:
            n_mask = n_mask & (n >= first)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every tile holds at least one real position, so m_new is finite and
        # exp2(m_i - m_new) is 0 on the first tile (m_i = -inf), never NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        # No reduce pass needed. An empty context (padding row) has l = 0: write zeros.
        if SINKS:
            m_i, l_i, acc = _join_sink(sinks_ptr, heads, g_mask, m_i, l_i, acc)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        dst = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Empty splits store m = -inf, l = 0, acc = 0, which the reduce weighs by 0.
        row = (b.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_G] into [B, H, S]
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)


@triton.jit
def _join_sink(sinks_ptr, heads, mask, m_i, l_i, acc):
    """A sink logit per row (``[R]`` heads; log2 units) joins the online softmax as one
    more score that weighs no value: the max and sum rescaled to ``max(m, sink)``, the
    sink's own ``2^(sink - max)`` added to the sum."""
    sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0)
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)  # 0 for an empty row (m = -inf)
    l_i = l_i * alpha + tl.exp2(sink - m_new)
    return m_new, l_i, acc * alpha[:, None]


@triton.jit
def decode_reduce_kernel(
    part_m_ptr,  # [B, H, NUM_SPLITS]
    part_l_ptr,  # [B, H, NUM_SPLITS]
    part_acc_ptr,  # [B, H, NUM_SPLITS, D]
    out_ptr,  # [B, H, D]
    sinks_ptr,  # [H] f32 sink logits * log2(e), read when SINKS
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= NUM_SPLITS
    SINKS: tl.constexpr = False,
):
    # Grid (B, H). Merges the splits' partial softmaxes: with M the largest split max,
    # out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    row = (b * tl.num_programs(1) + h) * NUM_SPLITS + s  # [BLOCK_S]
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    if SINKS:  # the sink: one more score in the denominator, weighing no value
        sink = tl.load(sinks_ptr + h)
        m_max = tl.maximum(m_max, sink)
    # All splits empty (a padding row): keep exp2 away from -inf - -inf = NaN.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # [BLOCK_S], 0 for empty splits
    denom = tl.sum(w * l_s, 0)
    if SINKS:
        denom += tl.exp2(sink - m_max)
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)  # [BLOCK_D]
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask
    )


@triton.jit
def _prefill_tile(
    q,  # [BLOCK_M, BLOCK_D] queries of this tile
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    kv_head,
    rows,  # [BLOCK_M] position of each query row within the context
    start,
    ctx,
    d,
    d_mask,
    qk_scale,
    window,
    softcap,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # False when every row of the tile sees every key of this tile
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One step of online softmax over the keys ``start .. start + BLOCK_N - 1``. With a
    window a row may see none of a tile's keys (max -inf): it then adds nothing."""
    n = start + tl.arange(0, BLOCK_N)
    n_mask = n < ctx
    offs = _kv_tile_offsets(
        bt_row, n, n_mask, kv_head, d, stride_cb, stride_cs, stride_ch, BLOCK_SIZE
    )
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(
        q.dtype
    )  # [BLOCK_N, BLOCK_D], as decode
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if SOFTCAP:
        s = _soft_cap(s, softcap)
    if WINDOWED:
        seen = (n[None, :] <= rows[:, None]) & (n[None, :] > rows[:, None] - window)
        s = tl.where(seen & n_mask[None, :], s, float("-inf"))
    elif CAUSAL:
        s = tl.where((n[None, :] <= rows[:, None]) & n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if WINDOWED:  # a row with nothing visible yet: exp2(-inf - -inf) would be NaN
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def prefill_kernel(
    q_ptr,  # [Tp, H, D], the prefill rows of the step
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [Tp, H, D]
    block_tables_ptr,  # [Bp, MB] int32
    seq_lens_ptr,  # [Bp] int32, context after the step (cached + this chunk)
    query_start_ptr,  # [Bp + 1] int32, may start at an offset (rows after the decodes)
    sinks_ptr,  # [H] f32 sink logits * log2(e), read when SINKS
    qk_scale,
    window,  # as decode_kernel's
    softcap,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per step
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    SINKS: tl.constexpr = False,
):
    # Grid (cdiv(max chunk length, BLOCK_M), H, Bp): one tile of BLOCK_M query rows of
    # one head of one sequence. The chunk's rows are the last q_len positions of a
    # context of ctx tokens (bottom-right aligned causal mask): row r sits at position
    # offset + r with offset = ctx - q_len, and sees keys 0 .. offset + r.
    tile = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.program_id(2)
    first = tl.load(query_start_ptr)
    q_start = tl.load(query_start_ptr + i) - first
    q_len = tl.load(query_start_ptr + i + 1) - first - q_start
    m0 = tile * BLOCK_M
    if m0 >= q_len:  # the grid is sized for the longest chunk of the batch
        return
    ctx = tl.load(seq_lens_ptr + i)
    offset = ctx - q_len
    kv_head = head // GROUP

    r = m0 + tl.arange(0, BLOCK_M)
    r_mask = r < q_len
    rows = offset + r  # [BLOCK_M] positions of the query rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    tok = (q_start + r).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + i.to(tl.int64) * stride_bt
    # Keys 0 .. offset + m0 are visible to every row of the tile: the whole tiles among
    # them need no mask (the bulk of the work for a chunk after a long cached prefix).
    # Key 0 is visible to every row, so each row's max is finite after its first tile.
    # With a window every tile is masked, from the tile of the first row's first key.
    unmasked_end = (offset + m0 + 1) // BLOCK_N * BLOCK_N
    band_start = unmasked_end
    if WINDOWED:
        band_start = tl.maximum(offset + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
        unmasked_end = 0
    for start in range(0, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            kv_head,
            rows,
            start,
            ctx,
            d,
            d_mask,
            qk_scale,
            window,
            softcap,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
            BLOCK_N,
            False,
            DOT_PRECISION,
            WINDOWED,
            SOFTCAP,
        )
    # The diagonal band: keys up to the last row's position (rows past q_len are clipped
    # by ctx and never stored).
    hi = tl.minimum(ctx, offset + m0 + BLOCK_M)
    for start in range(band_start, hi, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            kv_head,
            rows,
            start,
            ctx,
            d,
            d_mask,
            qk_scale,
            window,
            softcap,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
            BLOCK_N,
            True,
            DOT_PRECISION,
            WINDOWED,
            SOFTCAP,
        )

    if SINKS:
        m_i, l_i, acc = _join_sink(sinks_ptr, head + 0 * r, r_mask, m_i, l_i, acc)
    out = acc / l_i[:, None]
    dst = out_ptr + tok[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])
