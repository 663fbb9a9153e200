"""LoRA's native segmented shrink and expand (``cpu_lora.cpp``) against the torch path it
replaces (``model.lora.LoraRows.add``), on both ISA builds: several adapters of several
ranks over rows scattered through the batch, fused slices, an adapter without the
projection; rows without an adapter are left exactly as they were. Adapters stored in
float16 and bfloat16 (``--lora-dtype``) run the same kernel, widened in registers: the
torch path widens the same stored weights, so the two agree as closely as for float32."""

from __future__ import annotations

import pytest
import torch

from structllm.kernels import cpu_ext
from structllm.model import lora
from structllm.model.lora import LoraAdapter, LoraRows, Part, step_rows

pytestmark = pytest.mark.skipif(cpu_ext.best_isa() is None, reason="no AVX2 on this CPU")
ISAS = [i for i in cpu_ext.ISAS if cpu_ext.best_isa() in (i, "avx512")]
K, N = 100, 160  # the projection's input and (fused) output widths (neither a multiple of 64)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def part(a: torch.Tensor, b: torch.Tensor, col: int, dtype: torch.dtype = torch.float32) -> Part:
    """``a [r, K]`` and ``b [n, r]`` stored as the registry stores them for the native
    kernels (transposed, the rank padded to ``RANK_ALIGN``)."""
    return lora.stored_part(a, b, col, dtype, torch.device("cpu"), lora.RANK_ALIGN)


def adapter(
    uid: int, g: torch.Generator, slices: list[tuple[int, int, int]], dtype: torch.dtype
) -> LoraAdapter:
    """An adapter of layer 0's "qkv" with a part per ``(rank, first column, width)``,
    its weights stored in ``dtype``."""
    parts = [
        part(torch.randn(r, K, generator=g), (torch.randn(r, n, generator=g) * 0.1).t(), col, dtype)
        for r, col, n in slices
    ]
    out = LoraAdapter(uid, f"a{uid}", uid, "/nowhere")
    out.layers[0] = {"qkv": parts} if parts else {}
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("isa", ISAS)
def test_native_lora_add_equals_the_torch_path(isa: str, dtype: torch.dtype) -> None:
    native = cpu_ext.load_lora(isa)
    if native is None:
        pytest.skip(f"the {isa} LoRA kernel does not build here")
    g = torch.Generator().manual_seed(0)
    a = adapter(1, g, [(8, 0, 64), (4, 64, 48), (16, 112, 48)], dtype)  # q, k, v: ranks 8, 4, 16
    b = adapter(2, g, [(3, 0, N)], dtype)  # the whole output
    c = adapter(3, g, [], dtype)  # adapts other projections only
    spans = [(None, 2), (a, 1), (b, 5), (a, 3), (None, 1), (c, 2), (b, 1)]
    t = sum(n for _, n in spans)
    x = torch.randn(t, K, generator=g)
    base = torch.randn(t, N, generator=g)
    want, got = base.clone(), base.clone()
    ref = step_rows(spans, torch.device("cpu"))
    fast = step_rows(spans, torch.device("cpu"), native)
    assert isinstance(ref, LoraRows) and isinstance(fast, LoraRows)
    ref.add(0, "qkv", x, want)
    fast.add(0, "qkv", x, got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = [0, 1, 11, 12, 13]  # the rows without an adapter, and c's
    assert torch.equal(got[plain], base[plain])
    assert not torch.equal(got[2], base[2])
    fast.add(1, "qkv", x, got)  # a layer none adapts: nothing
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a row's result does not depend on the rows beside it (bit for bit): b's row 14 alone
    alone = base[14:15].clone()
    one = step_rows([(b, 1)], torch.device("cpu"), native)
    assert one is not None
    one.add(0, "qkv", x[14:15].contiguous(), alone)
    assert torch.equal(alone[0], got[14])


@pytest.mark.parametrize("isa", ISAS)
def test_one_pass_two_passes_and_block_sizes_give_the_same_bits(isa: str) -> None:
    # cpu_lora.h's run: with blocks enough for every thread each (part, block) unit
    # shrinks and expands at once, else two passes (the expand cut by columns); blocks
    # of up to 16 rows, or fewer; a row's sums are the same every way. 20 adapters of one
    # row, and one of 19 rows (a full block and a partial one; groups of 4 and lone
    # rows), every form forced
    native = cpu_ext.load_lora(isa)
    if native is None:
        pytest.skip(f"the {isa} LoRA kernel does not build here")
    g = torch.Generator().manual_seed(1)
    wide = 600  # an expand of five column chunks (4 x 128 + 88: a tail of 24 past the tiles)
    adapters = [adapter(i + 1, g, [(16, 0, 64), (8, 64, 96)], torch.float32) for i in range(20)]
    for a in adapters:
        a.layers[0]["o"] = [
            part(torch.randn(16, K, generator=g), torch.randn(16, wide, generator=g).t(), 0)
        ]
    # (fuse_blocks_per_thread, rows_per_block): one pass always, two always, by block size
    forms = [(0, 16), (1 << 40, 16), (0, 8), (1 << 40, 3), (0, 1)]
    for spans in ([(a, 1) for a in adapters], [(None, 1), (adapters[0], 19)]):
        t = sum(n for _, n in spans)
        x = torch.randn(t, K, generator=g)
        rows = step_rows(spans, torch.device("cpu"), native)
        assert rows is not None
        outs = []
        for fuse, per in forms:
            was = native.fuse_blocks_per_thread(fuse), native.rows_per_block(per)
            try:
                qkv, o = torch.zeros(t, N), torch.zeros(t, wide)
                rows.add(0, "qkv", x, qkv)
                rows.add(0, "o", x, o)
            finally:
                native.fuse_blocks_per_thread(was[0]), native.rows_per_block(was[1])
            outs.append((qkv, o))
        for qkv, o in outs[1:]:
            assert torch.equal(qkv, outs[0][0]) and torch.equal(o, outs[0][1])
        assert outs[0][1].abs().sum() > 0
