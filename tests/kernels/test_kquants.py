"""The k-quants as the file lays them out (``cpu_kquants.h``): Q4_K, Q5_K and Q6_K held at
the file's 144, 176 and 210 bytes per 256 weights, and their integer paths exactly the
arithmetic they promise.

``test_quant_kernels.py`` runs them with every other type (gguf's dequantisation, the
float64 reference within each path's bound, batch invariance); here the integer paths
are held to their own arithmetic: activations rounded per block of 32 by the kernels'
quantiser (emulated in numpy), every product of integers exact, the minima through the
blocks' activation sums. What is left is float32 rounding of the fold, so a misplaced
sub-block scale, minimum, nibble or high bit shows at once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from structllm.kernels import cpu_ext, packed
from structllm.kernels.packed import INT8, INT16, BlockWeight

from .test_quant_kernels import ISAS, M_SIZES, quantize, random_weight

pytestmark = pytest.mark.skipif(not ISAS, reason="the block kernels need an AVX2/FMA/F16C CPU")


def quantised_activations(x: np.ndarray, levels: int) -> np.ndarray:
    """``x [M, K]`` as the kernels' ``quant_block`` rounds it, dequantised (float64):
    per block of 32, ``d = max|x| / levels``, ``q = rint(x * (1 / d))`` in float32."""
    m, k = x.shape
    b = x.reshape(m, k // 32, 32).astype(np.float32)
    d = (np.abs(b).max(axis=2, keepdims=True) / np.float32(levels)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint((b * inv).astype(np.float32))
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(m, k)


K_TYPES = list(packed.FILE_BYTES)


def levels(type_name: str, mode: int) -> int:
    """The activation quantiser's levels: 8 bits on the int8 path (every k-quant takes
    it), 16 on the int16 one."""
    return 127 if mode == INT8 and type_name in packed.INT8_TYPES else 32767


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", [INT8, INT16])
@pytest.mark.parametrize("k", [768, 2816])
@pytest.mark.parametrize("type_name", K_TYPES)
def test_k_quant_integer_paths_are_their_exact_arithmetic(
    isa: str, mode: int, k: int, type_name: str
) -> None:
    """Against float64 over the rounded activations and gguf's weights: only the fold's
    float32 roundings remain (relative 1e-6), at every row count (the row kernel on the
    file's super-blocks up to 8 rows, the blocked GEMM reading them past it), for rows
    past the last group of 8 (43 rows), and with K = 2816 (11 super-blocks) cut by the
    GEMM into several chunks of whole super-blocks, unequal in size."""
    module = cpu_ext.load_quant(isa)
    w, ref = quantize(random_weight(43, k, seed=3), type_name, seed=3)
    gen = torch.Generator().manual_seed(4)
    for m in M_SIZES:
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        xr = quantised_activations(x.numpy(), levels(type_name, mode))
        want = torch.from_numpy(xr @ ref.double().numpy().T)
        got = module.linear(x, w.raw, w.code, mode).double()
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-6, (m, rel)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", [INT8, INT16])
@pytest.mark.parametrize("type_name", K_TYPES)
def test_k_quant_rows_do_not_depend_on_the_batch_at_prefill_sizes(
    isa: str, mode: int, type_name: str
) -> None:
    """Bit for bit, a row's output is the same alone (the row kernel), in a batch of 16
    or 64 (the blocked GEMM: one block of activation rows) and in one of 257 (two
    blocks of rows, the last padded), with K = 2816 cut into chunks of super-blocks:
    every output folds its sub-blocks in k order whatever tiles the GEMM runs."""
    module = cpu_ext.load_quant(isa)
    w, _ = quantize(random_weight(43, 2816, seed=8), type_name, seed=8)
    x = torch.randn(257, 2816, generator=torch.Generator().manual_seed(9))
    full = module.linear(x, w.raw, w.code, mode)
    picks = [0, 5, 15, 16, 63, 64, 200, 256]
    alone = torch.cat([module.linear(x[i : i + 1], w.raw, w.code, mode) for i in picks])
    assert torch.equal(full[picks], alone)
    for m in (16, 64):
        assert torch.equal(module.linear(x[:m], w.raw, w.code, mode), full[:m]), m


@pytest.mark.parametrize("isa", ISAS)
def test_q4k_largest_quants_and_scales_do_not_overflow(isa: str) -> None:
    """Every nibble 15, every 6-bit scale and minimum 63, activations at +-127 after
    rounding: a sub-block's integer sum is 32 * 15 * 127, past int16 (vpmaddubsw's pairs
    stay within it: 2 * 15 * 127)."""
    module = cpu_ext.load_quant(isa)
    n, k = 16, 512
    raw = np.full((n, k // 256, 144), 0xFF, dtype=np.uint8)
    raw[..., 0:2] = np.array([1e-2], dtype=np.float16).view(np.uint8)
    raw[..., 2:4] = np.array([1e-3], dtype=np.float16).view(np.uint8)
    w = BlockWeight.from_raw(raw.reshape(n, -1), "Q4_K", k)
    ref = w.dequantize().double()
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    for mode in (INT8, INT16):
        got = module.linear(x, w.raw, w.code, mode).double()
        assert torch.allclose(got, x.double() @ ref.T, rtol=1e-6, atol=1e-6), mode


@pytest.mark.parametrize("isa", ISAS)
def test_q6k_extreme_quants_and_scales_do_not_overflow(isa: str) -> None:
    """Q6_K's quants at -32 and 31 (every bit clear or set) under int8 scales -128 and
    127, activations at +-32767 (int8: +-127) after rounding: a scale's 16-weight integer
    sum reaches 16 * 32 * 32767 (past int16 and any pair's vpmaddwd lane, within int32);
    on the int8 path a pair of vpmaddubsw products reaches 2 * 63 * 127 (the GEMM's
    unsigned q + 32) or 2 * 32 * 127 (the row kernel's |q|). Against the rounded
    activations: the two halves' folds (scales 127 and -128) cancel terms of ~64, whose
    float32 roundings (2^-24 of each) are what remains; an overflow would be ~64 off."""
    module = cpu_ext.load_quant(isa)
    n, k = 16, 512
    raw = np.zeros((n, k // 256, 210), dtype=np.uint8)
    raw[::2, :, :192] = 0xFF  # even rows: q = 63 - 32 = 31; odd rows: q = 0 - 32
    raw[:, :, 192:208] = np.array([127, 0x80] * 8, dtype=np.uint8)  # scales 127, -128
    raw[..., 208:210] = np.array([1e-3], dtype=np.float16).view(np.uint8)
    w = BlockWeight.from_raw(raw.reshape(n, -1), "Q6_K", k)
    ref = w.dequantize().double()
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    for mode in (INT8, INT16):
        xr = torch.from_numpy(quantised_activations(x.numpy(), levels("Q6_K", mode)))
        for m in (3, 16):  # the row kernel, the blocked GEMM
            xm = xr.repeat(6, 1)[:m]
            got = module.linear(xm.float(), w.raw, w.code, mode).double()
            assert torch.allclose(got, xm @ ref.T, rtol=0, atol=1e-3), (mode, m)


@pytest.mark.parametrize("type_name", K_TYPES)
def test_k_quant_is_held_as_the_files_bytes(type_name: str) -> None:
    """No copy larger than the file: rows, fused parts and column halves (cut at whole
    super-blocks) keep the file's bytes per 256 weights (144, 176, 210); a cut inside a
    super-block is refused (the loader then dequantises that one matrix and says so)."""
    w, ref = quantize(random_weight(24, 1024, seed=5), type_name, seed=5)
    assert w.nbytes == 24 * 1024 // 256 * packed.FILE_BYTES[type_name]
    assert torch.equal(w.dequantize(), ref)
    half = w.columns(512, 1024)
    assert half is not None and half.nbytes == w.nbytes // 2
    assert torch.equal(half.dequantize(), ref[:, 512:])
    assert w.columns(256, 640) is None and w.columns(32, 512) is None
    rows = w.select_rows(torch.tensor([5, 1]))
    assert rows.nbytes == 2 * w.nbytes // 24 and torch.equal(rows.dequantize(), ref[[5, 1]])
    fused = BlockWeight.cat([w.row_range(0, 8), w.row_range(8, 24)])
    assert fused.nbytes == w.nbytes and torch.equal(fused.dequantize(), ref)
