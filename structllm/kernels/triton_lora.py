# mypy: allow-untyped-defs
"""LoRA's segmented shrink and expand in Triton: the CUDA path of ``model.lora``
(``model.lora_slots`` stacks the adapters and calls these), one launch each per adapted
projection per step, whatever the number of adapters in it.

Layouts (S adapter slots, P parts of the projection: 3 for ``qkv`` (q, k, v), 2 for
``gate_up``, 1 for ``o`` and ``down``; R the slots' rank, K its input width, W its
widest part; G the step's adapters, NR their rows):

- ``a``: ``[S, P, R, K]`` each slot's ``A`` per part, ``bt``: ``[S, P, R, W]`` its
  ``(scale * B)^T``, in the adapters' dtype (float32, float16, bfloat16); ``ranks``:
  ``[S, P]`` int32, the rank each slot's adapter has on each part (0: it does not adapt
  that part; rows past the rank are never read, so a slot is not cleared between
  adapters).
- ``rows``: ``[NR]`` int64, the step's adapter rows of the flat batch, group after
  group, group ``g``'s ``rows[starts[g] .. starts[g + 1])`` (``starts``: ``[G + 1]``
  int32), in slot ``slots[g]`` (``[G]`` int32). Rows in no group are not touched.
- ``t``: ``[P, NR, BLOCK_R]`` float32, the shrink's ``A x`` per part and adapter row.

Every product is float32 whatever the stored types (each tile widened as it is loaded,
``tl.dot`` at "ieee" precision: no TF32 rounding), and ``out`` gets one rounding, of
``out + B (A x)``. The grids have an axis over the step's groups and one over blocks of
``BLOCK_M`` rows: a program past its group's rows (or on a part its adapter lacks)
returns at once. ``BLOCK_M`` is fixed, not chosen from the batch, so a row is computed
by the same tiles and the same order of sums whatever rows are beside it.

The jit functions' parameters cannot carry Python type annotations (Triton reads them
as specialisation hints), hence the ``allow-untyped-defs`` at the top of this file.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_M = 16  # rows per program (tl.dot's least); fixed: see the top of the file
BLOCK_K = 64  # input columns per shrink iteration
BLOCK_N = 64  # output columns per expand program


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, K], unit column stride
    a_ptr,  # [S, P, R, K]
    t_ptr,  # [P, NR, BLOCK_R] float32
    rows_ptr,  # [NR] int64
    starts_ptr,  # [G + 1] int32
    slots_ptr,  # [G] int32
    ranks_ptr,  # [S, P] int32
    K,
    stride_x,
    stride_as,
    stride_ap,
    stride_ar,
    stride_tp,
    stride_tn,
    NUM_PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,  # max(16, next power of two >= R)
    BLOCK_K: tl.constexpr,
):
    # Grid (row blocks of the longest group, P, G): t[p, i] = A_slot,p x[rows[i]] for
    # the block's rows i of group g.
    m = tl.program_id(0)
    p = tl.program_id(1)
    g = tl.program_id(2)
    first = tl.load(starts_ptr + g)
    n = tl.load(starts_ptr + g + 1) - first
    slot = tl.load(slots_ptr + g)
    rank = tl.load(ranks_ptr + slot * NUM_PARTS + p)
    if m * BLOCK_M >= n or rank == 0:
        return
    i = m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] the block's rows in the group
    i_mask = i < n
    row = tl.load(rows_ptr + first + i, mask=i_mask, other=0)  # [BLOCK_M] rows of x
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    kk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + slot.to(tl.int64) * stride_as + p * stride_ap
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + kk) < K
        xk = tl.load(
            x_ptr + row[:, None] * stride_x + (k + kk)[None, :],
            mask=i_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        ak = tl.load(
            a_base + r[:, None] * stride_ar + (k + kk)[None, :],
            mask=r_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_R, BLOCK_K]
        acc += tl.dot(xk, tl.trans(ak), input_precision="ieee")
    t = t_ptr + p * stride_tp + (first + i)[:, None].to(tl.int64) * stride_tn + r[None, :]
    tl.store(t, acc, mask=i_mask[:, None])


@triton.jit
def _expand_kernel(
    t_ptr,  # [P, NR, BLOCK_R] float32
    bt_ptr,  # [S, P, R, W]
    out_ptr,  # [T, N], unit column stride, updated in place
    rows_ptr,  # [NR] int64
    starts_ptr,  # [G + 1] int32
    slots_ptr,  # [G] int32
    ranks_ptr,  # [S, P] int32
    cols_ptr,  # [P] int32: each part's first column of out
    widths_ptr,  # [P] int32: each part's width
    stride_tp,
    stride_tn,
    stride_bs,
    stride_bp,
    stride_br,
    stride_o,
    NUM_PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Grid (row blocks of the longest group, column blocks of W, P * G):
    # out[rows[i], col_p + c] += t[p, i] . bt[slot, p, :, c] for the block's rows i of
    # group g and its columns c.
    m = tl.program_id(0)
    c0 = tl.program_id(1) * BLOCK_N
    p = tl.program_id(2) % NUM_PARTS
    g = tl.program_id(2) // NUM_PARTS
    first = tl.load(starts_ptr + g)
    n = tl.load(starts_ptr + g + 1) - first
    slot = tl.load(slots_ptr + g)
    rank = tl.load(ranks_ptr + slot * NUM_PARTS + p)
    width = tl.load(widths_ptr + p)
    if m * BLOCK_M >= n or rank == 0 or c0 >= width:
        return
    col = tl.load(cols_ptr + p)
    i = m * BLOCK_M + tl.arange(0, BLOCK_M)
    i_mask = i < n
    row = tl.load(rows_ptr + first + i, mask=i_mask, other=0)
    r = tl.arange(0, BLOCK_R)
    c = c0 + tl.arange(0, BLOCK_N)
    c_mask = c < width
    # lanes past the rank: t holds what the shrink left there, B^T's rows load as 0
    t = tl.load(
        t_ptr + p * stride_tp + (first + i)[:, None].to(tl.int64) * stride_tn + r[None, :],
        mask=i_mask[:, None] & (r < rank)[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_R]
    b = tl.load(
        bt_ptr
        + slot.to(tl.int64) * stride_bs
        + p * stride_bp
        + r[:, None] * stride_br
        + c[None, :],
        mask=(r < rank)[:, None] & c_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_R, BLOCK_N]
    y = tl.dot(t, b, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    o = out_ptr + row[:, None] * stride_o + (col + c)[None, :]
    mask = i_mask[:, None] & c_mask[None, :]
    old = tl.load(o, mask=mask, other=0.0).to(tl.float32)
    tl.store(o, (old + y).to(out_ptr.dtype.element_ty), mask=mask)


def block_r(rank: int) -> int:
    """The rank lanes of a program: ``rank`` rounded up to a power of two, at least 16
    (``tl.dot``'s least)."""
    return max(16, triton.next_power_of_2(rank))


def shrink(
    x: Tensor,
    a: Tensor,
    ranks: Tensor,
    rows: Tensor,
    starts: Tensor,
    slots: Tensor,
    longest: int,
) -> Tensor:
    """``t [P, NR, block_r(R)]`` float32: each group's rows of ``x [T, K]`` times its
    slot's ``A`` per part (see the top of the file); ``longest``: the most rows of one
    group (the grid's rows, known on the host so no launch waits on the device)."""
    parts, rank, k = a.shape[1:]
    br = block_r(rank)
    t = torch.empty(parts, rows.numel(), br, dtype=torch.float32, device=x.device)
    groups = slots.numel()
    if groups == 0 or longest == 0:
        return t
    x = x if x.stride(1) == 1 else x.contiguous()
    _shrink_kernel[(triton.cdiv(longest, BLOCK_M), parts, groups)](
        x, a, t, rows, starts, slots, ranks, k,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2), t.stride(0), t.stride(1),
        NUM_PARTS=parts, BLOCK_M=BLOCK_M, BLOCK_R=br, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return t


def expand(
    t: Tensor,
    bt: Tensor,
    ranks: Tensor,
    cols: Tensor,
    widths: Tensor,
    out: Tensor,
    rows: Tensor,
    starts: Tensor,
    slots: Tensor,
    longest: int,
) -> None:
    """``out[row, col_p : col_p + width_p] += t[p, i] @ bt[slot, p]`` for each group's
    rows (``t`` from ``shrink``), in float32, one rounding to ``out``'s dtype."""
    if out.stride(1) != 1:
        raise ValueError("expand: out must have unit column stride (it is updated in place)")
    parts, w = bt.shape[1], bt.shape[3]
    groups = slots.numel()
    if groups == 0 or longest == 0:
        return
    grid = (triton.cdiv(longest, BLOCK_M), triton.cdiv(w, BLOCK_N), parts * groups)
    _expand_kernel[grid](
        t, bt, out, rows, starts, slots, ranks, cols, widths,
        t.stride(0), t.stride(1), bt.stride(0), bt.stride(1), bt.stride(2), out.stride(0),
        NUM_PARTS=parts, BLOCK_M=BLOCK_M, BLOCK_R=t.shape[2], BLOCK_N=BLOCK_N,
    )  # fmt: skip
