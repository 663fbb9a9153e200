"""The i-quant kernels (``cpu_iquants.h``, in quant_linear.cpp's module): IQ4_XS held as
the file's super-blocks, against ``gguf``'s dequantisation of the same bytes and a
float64 dot product, on both ISA builds (the AVX2 one forced on an AVX-512 machine by
loading it explicitly), for every path and M = 1, 3, 16, 64, 257.

Bounds: the float path's weights are gguf's bit for bit, so its only error is float32
summation (each output within K * 2^-24 of sum |w x|); the int8 path rounds each
activation to a multiple of its block's dx = max |x| / 127, within dx / 2 of it, so an
output is within sum |w_i| dx_i / 2 of the float64 product (plus the float sums').
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from structllm.kernels import cpu_ext
from structllm.kernels.packed import FLOAT, INT8, INT16, BlockWeight

gguf = pytest.importorskip("gguf")


def _available_isas() -> list[str]:
    flags = set(cpu_ext._cpu_flags().split())
    return [
        isa for isa, need in zip(cpu_ext.ISAS, cpu_ext._ISA_NEEDS, strict=True) if need <= flags
    ]


ISAS = _available_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="the block kernels need an AVX2/FMA/F16C CPU")
M_SIZES = [1, 3, 16, 64, 257]
SUPER_BYTES = 136  # IQ4_XS: d f16, scales_h u16, scales_l 4 bytes, 128 nibble bytes


def random_iq4xs(n: int, k: int, seed: int) -> tuple[BlockWeight, torch.Tensor]:
    """Random IQ4_XS super-blocks ``[n, k]`` (every byte random: all of it is valid
    nibbles and 6-bit scales) under float16 scales d of varied sizes, and gguf's float32
    dequantisation of them."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, SUPER_BYTES), dtype=np.uint8)
    d = rng.uniform(1e-4, 1e-2, (n, k // 256)).astype(np.float16)
    raw[..., 0:2] = d.view(np.uint8).reshape(n, k // 256, 2)
    raw = raw.reshape(n, -1)
    qtype = gguf.GGMLQuantizationType.IQ4_XS
    ref = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(n, k)
    w = BlockWeight.from_raw(torch.from_numpy(raw.copy()), "IQ4_XS", k)
    return w, torch.from_numpy(ref)


def int8_bound(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``[M, N]``: sum_i |w_i| dx_i / 2 (the activations' rounding) plus the float
    sums' K * 2^-23 * sum |w x|."""
    m, k = x.shape
    dx = x.abs().reshape(m, k // 32, 32).amax(dim=2) / 127  # [M, K/32]
    step = dx.repeat_interleave(32, dim=1).double()  # [M, K]
    rounding = 0.5 * step @ ref.abs().double().T
    return rounding * (1 + 1e-4) + k * 2.0**-23 * (x.abs().double() @ ref.abs().double().T)


@pytest.mark.parametrize("isa", ISAS)
def test_float_path_weights_are_gguf_s_bit_for_bit(isa: str) -> None:
    """The kernel's dequantisation and the float path's in-register weights (its
    product with identity rows: each weight times 1 plus zeros) equal gguf's float32
    dequantisation bit for bit."""
    module = cpu_ext.load_quant(isa)
    w, ref = random_iq4xs(24, 512, seed=0)
    assert w.raw.shape == (24, 2 * SUPER_BYTES)  # the file's bytes, nothing beside them
    assert torch.equal(module.dequantize(w.raw, w.code), ref)
    eye = torch.eye(512)
    for rows in (eye[:1], eye[:3], eye[:17], eye):
        got = module.linear(rows, w.raw, w.code, FLOAT)
        assert torch.equal(got, ref.T[: rows.shape[0]].contiguous())


@pytest.mark.parametrize("isa", ISAS)
def test_paths_match_a_float64_product_within_their_bounds(isa: str) -> None:
    module = cpu_ext.load_quant(isa)
    w, ref = random_iq4xs(40, 768, seed=1)
    gen = torch.Generator().manual_seed(2)
    for m in M_SIZES:
        x = torch.randn(m, 768, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        want = x.double() @ ref.double().T
        float_bound = 768 * 2.0**-24 * (x.abs().double() @ ref.abs().double().T)
        got = module.linear(x, w.raw, w.code, FLOAT).double()
        assert bool(((got - want).abs() <= float_bound).all()), m
        bound = int8_bound(x, ref)
        for mode in (INT8, INT16):  # IQ4_XS's int16 mode runs 8-bit activations
            got = module.linear(x, w.raw, w.code, mode).double()
            assert bool(((got - want).abs() <= bound).all()), (m, mode)
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < 2e-2, (m, mode, rel)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", [FLOAT, INT8, INT16])
def test_a_rows_result_does_not_depend_on_the_batch(isa: str, mode: int) -> None:
    """Bit for bit: a row's output is the same alone or among 1-34 others (every tile
    size and remainder of the kernels' row tiles, and the blocked kernel's vectors of 16
    rows), so a request's tokens do not depend on what else runs in its step."""
    w, _ = random_iq4xs(43, 512, seed=3)
    module = cpu_ext.load_quant(isa)
    x = torch.randn(35, 512, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([module.linear(x[i : i + 1], w.raw, w.code, mode) for i in range(35)])
    for m in (2, 3, 4, 5, 7, 8, 9, 17, 35):  # (the tiled kernel from 25 rows, AVX2 16)
        assert torch.equal(module.linear(x[:m], w.raw, w.code, mode), alone[:m]), m
    assert torch.equal(module.linear(x[5:9], w.raw, w.code, mode), alone[5:9])


@pytest.mark.parametrize("isa", ISAS)
def test_long_rows_in_many_blocks_do_not_depend_on_the_batch(isa: str) -> None:
    """The tiled kernel's cuts, bit for bit against each row alone: 33 super-blocks a
    row (chunks of 8 and a last one of 1), 101 rows (VNNI: vectors of 16 in blocks of 3,
    the last block one vector of 5 rows; AVX2: vectors of 8 in blocks of 7 and 6, the
    last 5 rows), 13 weight rows (panels of 6, or 4, and a last one of 1)."""
    w, _ = random_iq4xs(13, 33 * 256, seed=5)
    module = cpu_ext.load_quant(isa)
    x = torch.randn(101, 33 * 256, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([module.linear(x[i : i + 1], w.raw, w.code, INT8) for i in range(101)])
    assert torch.equal(module.linear(x, w.raw, w.code, INT8), alone)


@pytest.mark.parametrize("isa", ISAS)
def test_decode_rows_are_the_tiled_kernels_bits(isa: str) -> None:
    """1-24 activation rows (decode, speculative verification, batches) bit for bit as
    the same rows among 40 (the tiled kernel): on VNNI builds they run 16 weight rows in
    a vector's lanes (here 4 groups of 16 and a last 6 rows on the row kernel, 33
    super-blocks a row, so each thread prefetches its next group), on AVX2 the row
    kernel and from 16 rows the tile."""
    w, _ = random_iq4xs(70, 33 * 256, seed=7)
    module = cpu_ext.load_quant(isa)
    x = torch.randn(40, 33 * 256, generator=torch.Generator().manual_seed(8))
    many = module.linear(x, w.raw, w.code, INT8)
    for m in (1, 2, 3, 4, 8, 16, 24):
        assert torch.equal(module.linear(x[:m], w.raw, w.code, INT8), many[:m]), m


def test_weights_are_whole_super_blocks() -> None:
    """Columns come in whole super-blocks of 256: a width or a cut inside one is
    refused, rows and cuts at 256 keep blocks valid."""
    raw = torch.zeros(4, SUPER_BYTES * 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="IQ4_XS with 384 columns"):
        BlockWeight.from_raw(raw.reshape(-1)[: 4 * 3 * 68], "IQ4_XS", 384)
    w, ref = random_iq4xs(6, 512, seed=5)
    assert w.columns(0, 128) is None and w.columns(32, 512) is None
    right = w.columns(256, 512)
    assert right is not None and torch.equal(right.dequantize(), ref[:, 256:])
    assert torch.equal(w.row_range(2, 5).dequantize(), ref[2:5])
    assert torch.equal(w.rows(torch.tensor([4, 0])), ref[[4, 0]])


@pytest.mark.parametrize("isa", ISAS)
def test_linear_refuses_rows_that_are_not_whole_super_blocks(isa: str) -> None:
    module = cpu_ext.load_quant(isa)
    with pytest.raises(RuntimeError, match="IQ4_XS row bytes"):
        module.linear(torch.zeros(1, 256), torch.zeros(2, 100, dtype=torch.uint8), 11, INT8)
