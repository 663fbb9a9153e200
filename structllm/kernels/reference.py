"""Paged attention in plain torch: the CPU path and the oracle for the Triton kernels.

Shapes (T tokens in the step, B sequences, H query heads, Hkv KV heads, D head size,
NB blocks of BS token slots each, MB block-table columns):

- ``k_cache``, ``v_cache``: ``[NB, BS, Hkv, D]``; slot ``s`` is ``[s // BS, s % BS]``.
- ``block_tables``: ``[B, MB]`` int32; column ``j`` is the block holding positions
  ``j*BS .. j*BS+BS-1`` of that sequence; columns past the sequence are padding.
- ``seq_lens[i]``: the context length of sequence ``i`` after this step, i.e. tokens
  already cached plus this step's query tokens (which are stored before attending).

GQA: query head ``h`` reads KV head ``h // (H // Hkv)``.

The cache may be narrower than the activations (``--kv-cache-dtype float16`` with
float32 ones): stores round to the cache's dtype, reads widen back (decode computes in
float32, prefill in the query's dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write ``k, v: [T, Hkv, D]`` into the cache slots ``slot_mapping: [T]`` (int64),
    converted to the cache's dtype (index_copy_ wants equal dtypes)."""
    nb, bs, hkv, d = k_cache.shape
    k_cache.view(nb * bs, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: Tensor, block_table: Tensor, length: int) -> Tensor:
    """The first ``length`` positions of one sequence as a contiguous ``[length, Hkv, D]``."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    return cache[block_table[:nblocks]].flatten(0, 1)[:length]


def gather_kv_transposed(cache: Tensor, block_table: Tensor, length: int) -> Tensor:
    """``gather_kv`` for a block-transposed cache ``[NB, Hkv, D, BS]``."""
    bs = cache.shape[3]
    nblocks = (length + bs - 1) // bs
    return cache[block_table[:nblocks]].permute(0, 3, 1, 2).flatten(0, 1)[:length]


def store_k_transposed(k: Tensor, k_cache: Tensor, slot_mapping: Tensor) -> None:
    """``store_kv``'s K half for a block-transposed cache ``[NB, Hkv, D, BS]``."""
    bs = k_cache.shape[3]
    # writes through the view; index_put_ wants equal dtypes
    k_cache.permute(0, 3, 1, 2)[slot_mapping // bs, slot_mapping % bs] = k.to(k_cache.dtype)


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    max_seq_len: int,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    chunk: int = 0,
) -> Tensor:
    """One query token per sequence: ``q: [B, H, D]`` -> ``[B, H, D]``.

    Gathers whole blocks (``[B, L, Hkv, D]`` with ``L = ceil(max_seq_len / BS) * BS``),
    masks the slots past each sequence's length (and, with a ``window``, those before
    its last ``window``; with a ``chunk``, chunked local attention, Llama 4's: those
    before the start of the query's chunk, ``floor(p / chunk) * chunk`` for the query
    at position ``p``), and runs one batched GQA attention per KV head
    (``[B, G, D] x [B, D, L]``: strided views, no transposed copies). ``softcap``: scores
    become ``softcap * tanh(score / softcap)`` before the mask. ``sinks: [H]`` (gpt-oss):
    one more logit per head in each row's softmax, in the scaled scores' units, that
    weighs no value (its share of the denominator is attention paid to nothing).
    """
    b, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    nblocks = (max_seq_len + bs - 1) // bs
    length = nblocks * bs
    index = block_tables[:, :nblocks].reshape(-1).to(torch.long)
    k = k_cache.index_select(0, index).view(b, length, hkv, d)
    v = v_cache.index_select(0, index).view(b, length, hkv, d)
    pos = torch.arange(length, device=q.device)
    past_end = pos >= seq_lens[:, None].to(torch.long)  # [B, L]
    if window:
        past_end |= pos < seq_lens[:, None].to(torch.long) - window
    if chunk:
        past_end |= pos < (seq_lens[:, None].to(torch.long) - 1) // chunk * chunk
    bias = torch.zeros(b, 1, length, dtype=torch.float32, device=q.device).masked_fill_(
        past_end[:, None], float("-inf")
    )
    g = h // hkv
    qg = q.view(b, hkv, g, d).float()  # heads of one KV group are adjacent
    out = torch.empty(b, hkv, g, d, dtype=q.dtype, device=q.device)
    for j in range(hkv):
        if softcap:
            scores = torch.bmm(qg[:, j], k[:, :, j].transpose(1, 2).float()) * scale
            scores = torch.tanh(scores / softcap) * softcap + bias
        else:
            scores = torch.baddbmm(
                bias, qg[:, j], k[:, :, j].transpose(1, 2).float(), alpha=scale
            )  # [B, G, L]
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:  # the sink as column L, dropped after the softmax
            sink = sinks[j * g : (j + 1) * g].float()[None, :, None].expand(b, g, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :length]
        out[:, j] = torch.bmm(probs, v[:, :, j].float()).to(q.dtype)
    return out.view(b, h, d)


def prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    k_new: Tensor | None = None,
    v_new: Tensor | None = None,
    k_transposed: bool = False,
    window: int = 0,
    softcap: float = 0.0,
    ahead: Tensor | None = None,
    ahead_seqs: frozenset[int] = frozenset(),
    sinks: Tensor | None = None,
    chunk: int = 0,
) -> Tensor:
    """Causal attention for prefill chunks: ``q: [T, H, D]`` -> ``[T, H, D]``.

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; they are
    its last ``q_len`` positions out of ``seq_lens[i]``, so query row ``r`` may see keys
    ``0 .. seq_lens[i] - q_len + r``. When a sequence's whole context is this step's
    tokens (no cached prefix), ``k_new``/``v_new: [T, Hkv, D]`` are used directly and
    the gather from the cache is skipped. ``k_transposed``: ``k_cache`` is in the
    block-transposed layout ``[NB, Hkv, D, BS]`` (the CPU backend's). Context read from
    a narrower cache is widened to ``q``'s dtype (SDPA wants equal dtypes); fresh
    sequences attend to ``k_new``/``v_new`` as computed (the C++ backend's prefill
    reads the cache instead, ``CpuAttention.prefill``). ``window``, ``softcap``, ``sinks``,
    ``chunk``: see ``decode_attention``; with any, each sequence goes through ``_masked_attention``.
    ``ahead: [T]`` (rows of ``q``): row ``r`` also sees the next ``ahead[r]`` keys after
    its own position (an image's tokens attending to the rest of the image), in the
    sequences ``ahead_seqs`` (indices into ``seq_lens``), which go through
    ``_masked_attention`` with that mask.
    """
    out = torch.empty_like(q)
    masked = bool(window or softcap or chunk) or sinks is not None
    fresh: dict[int, list[int]] = {}  # q_len -> sequences whose whole context is new
    for i in range(len(seq_lens)):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len, ctx = end - start, seq_lens[i]
        extra = ahead[start:end] if ahead is not None and i in ahead_seqs else None
        plain = not masked and extra is None
        if k_new is not None and v_new is not None and ctx == q_len and plain:
            fresh.setdefault(q_len, []).append(i)
            continue
        k = (
            gather_kv_transposed(k_cache, block_tables[i], ctx)
            if k_transposed
            else gather_kv(k_cache, block_tables[i], ctx)
        )
        v = gather_kv(v_cache, block_tables[i], ctx)
        k, v = k.to(q.dtype), v.to(q.dtype)  # [ctx, Hkv, D]; no copy when the dtypes agree
        if not plain:
            out[start:end] = _masked_attention(
                q[start:end], k, v, scale, window, softcap, extra, sinks, chunk
            )
        else:
            out[start:end] = _causal_sdpa(q[start:end], k, v, scale)
    for seqs in fresh.values():
        assert k_new is not None and v_new is not None
        rows = [slice(query_start_loc[i], query_start_loc[i + 1]) for i in seqs]
        if len(seqs) == 1:
            out[rows[0]] = _causal_sdpa(q[rows[0]], k_new[rows[0]], v_new[rows[0]], scale)
            continue
        # Equal-length fresh prompts (a burst of similar requests) in one batched call:
        # [S, Hq|Hkv, L, D], plain causal mask.
        qs = torch.stack([q[r] for r in rows]).transpose(1, 2)
        ks = torch.stack([k_new[r] for r in rows]).transpose(1, 2)
        vs = torch.stack([v_new[r] for r in rows]).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
        ).transpose(1, 2)
        for j, r in enumerate(rows):
            out[r] = o[j]
    return out


def _causal_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """``q: [Q, H, D]`` against ``k, v: [L, Hkv, D]`` with ``Q <= L``, where the queries are
    the last ``Q`` positions (bottom-right aligned causal mask)."""
    q_len, ctx = q.shape[0], k.shape[0]
    # [1, heads, len, D]: torch's CPU SDPA takes its fused (flash) kernel only for 4-D
    # inputs; 3-D ones fall back to the math path, 2.7x slower for a 128-token prompt of
    # SmolLM2-135M on a 2-vCPU Zen 3 (1.47 against 0.54 ms per layer)
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if q_len == ctx:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        rows = torch.arange(q_len, device=q.device)[:, None] + (ctx - q_len)
        mask = torch.arange(ctx, device=q.device)[None, :] <= rows  # [Q, L]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    window: int,
    softcap: float,
    ahead: Tensor | None = None,
    sinks: Tensor | None = None,
    chunk: int = 0,
) -> Tensor:
    """``_causal_sdpa`` with a sliding ``window``, soft-capped scores, rows that see
    ``ahead: [Q]`` keys past their own position, ``sinks`` and ``chunk`` (see
    ``decode_attention``):
    ``[Q, H, D]`` against ``[L, Hkv, D]``. With ``ahead`` and neither soft-cap nor sinks
    through SDPA with a boolean mask (no ``[H, Q, L]`` scores of our own for an image
    chunk), else in explicit ops (SDPA has neither; the windowed text rows keep the ops
    they were checked against transformers with)."""
    q_len, h, _ = q.shape
    if ahead is not None and not softcap and sinks is None:
        rows = torch.arange(q_len, device=q.device)[:, None] + (k.shape[0] - q_len)
        cols = torch.arange(k.shape[0], device=q.device)[None, :]
        last = rows if ahead is None else rows + ahead[:, None].to(rows.dtype)
        visible = cols <= last  # [Q, L]
        if window:
            visible &= cols > rows - window
        if chunk:
            visible &= cols >= rows // chunk * chunk
        qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=visible, scale=scale, enable_gqa=True
        )
        return o[0].transpose(0, 1)
    ctx, hkv, _ = k.shape
    g = h // hkv
    qh = q.transpose(0, 1).float()  # [H, Q, D]
    kh = k.transpose(0, 1).float().repeat_interleave(g, 0)  # [H, L, D]
    vh = v.transpose(0, 1).float().repeat_interleave(g, 0)
    scores = torch.bmm(qh, kh.transpose(1, 2)) * scale  # [H, Q, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    rows = torch.arange(q_len, device=q.device)[:, None] + (ctx - q_len)
    cols = torch.arange(ctx, device=q.device)[None, :]
    visible = cols <= (rows if ahead is None else rows + ahead[:, None].to(rows.dtype))
    if window:
        visible &= cols > rows - window
    if chunk:
        visible &= cols >= rows // chunk * chunk
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:  # the sink as column L, dropped after the softmax
        sink = sinks.float()[:, None, None].expand(h, q_len, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :ctx]
    return torch.bmm(probs, vh).transpose(0, 1).to(q.dtype)


def dense_causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    ahead: list[int] | None = None,
    sinks: Tensor | None = None,
    chunk: int = 0,
) -> Tensor:
    """Textbook attention for the tests: ``q: [Q, H, D]``, ``k, v: [L, Hkv, D]``, queries
    are the last ``Q`` of ``L`` positions (each seeing its last ``window`` keys, if set,
    only the keys of its own ``chunk`` (from the multiple of it at or before its
    position), if set,
    and ``ahead[r]`` keys past its own, if given; scores soft-capped by ``softcap``, if
    set; ``sinks: [H]`` adding ``exp(sink)`` to each denominator, if set). Computed in
    float64 with explicit loops over heads, sharing no code with the paths above."""
    q_len, h, d = q.shape
    ctx, hkv, _ = k.shape
    g = h // hkv
    out = torch.empty(q_len, h, d, dtype=torch.float64)
    for head in range(h):
        qh = q[:, head].double()
        kh, vh = k[:, head // g].double(), v[:, head // g].double()
        s = qh @ kh.T * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        for r in range(q_len):
            s[r, ctx - q_len + r + 1 + (ahead[r] if ahead else 0) :] = float("-inf")
            if window:
                s[r, : max(0, ctx - q_len + r + 1 - window)] = float("-inf")
            if chunk:
                s[r, : (ctx - q_len + r) // chunk * chunk] = float("-inf")
        if sinks is None:
            out[:, head] = torch.softmax(s, dim=-1) @ vh
        else:  # exp(sink) joins each row's denominator
            top = s.max(dim=-1, keepdim=True).values
            e = torch.exp(s - top)
            denom = e.sum(-1, keepdim=True) + torch.exp(float(sinks[head]) - top)
            out[:, head] = (e / denom) @ vh
    return out.to(q.dtype)
