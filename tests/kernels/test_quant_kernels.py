"""The GGUF block kernels (``quant_linear.cpp``) against the float32 dequantisation.

Every block type, both ISA builds (the AVX2 one is forced on an AVX-512 machine by
loading it explicitly), every path (float: weights dequantised exactly, float32 math,
in registers for a few rows and through a blocked GEMM for more; int16 and int8:
activations quantised per block), on random and on the default model's weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from structllm.kernels import cpu_ext, packed
from structllm.kernels.packed import BLOCK_TYPES, FLOAT, INT8, INT16, BlockWeight

gguf = pytest.importorskip("gguf")


def _available_isas() -> list[str]:
    flags = set(cpu_ext._cpu_flags().split())
    return [
        isa for isa, need in zip(cpu_ext.ISAS, cpu_ext._ISA_NEEDS, strict=True) if need <= flags
    ]


ISAS = _available_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="the block kernels need an AVX2/FMA/F16C CPU")
M_SIZES = [1, 3, 16, 64, 257]


def quantize(w: np.ndarray, type_name: str) -> tuple[BlockWeight, torch.Tensor]:
    """``w [N, K]`` float32 -> its blocks and their float32 dequantisation by ``gguf``."""
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(w, qtype)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(w.shape))
    return BlockWeight.from_raw(
        torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)), type_name, w.shape[1]
    ), ref


def random_weight(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, k)) * rng.uniform(0.1, 2.0, (n, 1))).astype(np.float32)


@pytest.fixture(scope="module")
def real_weights() -> dict[str, np.ndarray]:
    """Float32 matrices from the default model (its q/k/v of layer 0 and ffn_down of layer
    3, dequantised), to be re-quantised into each block type."""
    from structllm.model import gguf as our_gguf
    from structllm.model.files import default_model_path

    reader = our_gguf.open_gguf(default_model_path())
    out = {}
    for t in reader.tensors:
        if t.name in ("blk.0.attn_q.weight", "blk.3.ffn_down.weight"):
            shape = tuple(int(s) for s in reversed(t.shape))
            out[t.name] = our_gguf.dequantize(t.data, t.tensor_type.name, shape).numpy()
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_float_path_weights_are_bit_exact(isa: str, type_name: str) -> None:
    """The float path's in-register dequantisation equals gguf's float32 dequantisation
    bit for bit: checked on the kernel's dequantiser and on the matmul itself, whose
    product with the identity is each weight times 1 plus zeros."""
    module = cpu_ext.load_quant(isa)
    w, ref = quantize(random_weight(40, 160), type_name)
    assert torch.equal(module.dequantize(w.raw, w.code), ref)
    k = w.shape[1]
    # the in-register path (1, 3 rows) and the blocked one (17 rows: a padded vector;
    # 160: whole vectors and tiles), each with its remainder loops
    for rows in (torch.eye(k)[:1], torch.eye(k)[:3], torch.eye(k)[:17], torch.eye(k)):
        got = module.linear(rows, w.raw, w.code, FLOAT)
        assert torch.equal(got, (rows @ ref.T) if rows.shape[0] < k else ref.T.contiguous())


def check_against_reference(module: object, w: BlockWeight, ref: torch.Tensor, seed: int) -> None:
    torch.manual_seed(seed)
    for m in M_SIZES:
        x = torch.randn(m, w.shape[1])
        want = (x.double() @ ref.double().T).float()
        # float: float32 rounding only; int16: activations to 16 bits (measured 2.3e-5);
        # int8: to 8 bits
        for mode, tol in ((FLOAT, 1e-5), (INT16, 1e-4), (INT8, 2e-2)):
            got = module.linear(x, w.raw, w.code, mode)  # type: ignore[attr-defined]
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < tol, (m, mode, rel)
            # each row on its own: no row is much worse than the average
            row_rel = ((got - want).norm(dim=1) / want.norm(dim=1)).max().item()
            assert row_rel < 4 * tol, (m, mode, row_rel)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_random_weights_match_the_float_reference(isa: str, type_name: str) -> None:
    w, ref = quantize(random_weight(72, 224, seed=1), type_name)
    check_against_reference(cpu_ext.load_quant(isa), w, ref, seed=2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
@pytest.mark.parametrize("blocks", [1, 7, 8, 9, 16, 18, 19, 48])
def test_decode_rows_int16_match_the_float_reference(isa: str, type_name: str, blocks: int) -> None:
    """The int16 row kernel (decode sizes, 1-4 rows) folds the scales of 8 blocks at a
    time and the last blocks of a row one by one: whole groups, tails, and rows shorter
    than a group, for every row count it serves."""
    w, ref = quantize(random_weight(40, 32 * blocks, seed=blocks), type_name)
    gen = torch.Generator().manual_seed(blocks)
    for m in (1, 2, 3, 4):
        x = torch.randn(m, w.shape[1], generator=gen)
        want = (x.double() @ ref.double().T).float()
        got = cpu_ext.load_quant(isa).linear(x, w.raw, w.code, INT16)
        assert ((got - want).norm() / want.norm()).item() < 1e-4, m
        row_rel = ((got - want).norm(dim=1) / want.norm(dim=1)).max().item()
        assert row_rel < 4e-4, m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
@pytest.mark.parametrize("mode", [INT16, INT8])
@pytest.mark.parametrize("blocks", [7, 9, 18])
def test_a_rows_result_does_not_depend_on_the_batch(
    isa: str, type_name: str, mode: int, blocks: int
) -> None:
    """Bit for bit: a row's output is the same alone (the row kernel), with up to 3
    others, or in a batch of 9 or 17 (the blocked GEMM), on both integer paths and for
    the rows past the last group of 8 (43 = 5 x 8 + 3). The activations are rounded by
    one quantiser and every output folds its blocks in one order, so a request's tokens
    do not depend on what else runs in its step."""
    w, _ = quantize(random_weight(43, 32 * blocks, seed=blocks), type_name)
    module = cpu_ext.load_quant(isa)
    x = torch.randn(17, w.shape[1], generator=torch.Generator().manual_seed(blocks))
    alone = torch.cat([module.linear(x[i : i + 1], w.raw, w.code, mode) for i in range(17)])
    for m in (2, 3, 4, 5, 9, 17):
        assert torch.equal(module.linear(x[:m], w.raw, w.code, mode), alone[:m]), m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_default_model_weights_match_the_float_reference(
    isa: str, type_name: str, real_weights: dict[str, np.ndarray]
) -> None:
    for name, full in real_weights.items():
        w, ref = quantize(np.ascontiguousarray(full[:96]), type_name)  # 96 rows keep it quick
        check_against_reference(cpu_ext.load_quant(isa), w, ref, seed=len(name))


def test_the_dispatcher_picks_the_path_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    w, ref = quantize(random_weight(64, 128, seed=3), "Q4_1")
    module = cpu_ext.load_quant()
    small, big = torch.randn(8, 128), torch.randn(9, 128)

    def path(x: torch.Tensor, mode: int) -> torch.Tensor:
        return module.linear(x, w.raw, w.code, mode)

    monkeypatch.setattr(packed, "INT8_MIN_M", 0)  # int8 never
    monkeypatch.setattr(packed, "INT16_MIN_M", 5)  # int16 from 5 rows
    assert torch.equal(packed.linear(small[:4], w, int8_ok=True), path(small[:4], FLOAT))
    assert torch.equal(packed.linear(big, w, int8_ok=True), path(big, INT16))
    monkeypatch.setattr(packed, "INT16_MIN_M", 0)
    assert torch.equal(packed.linear(big, w), path(big, FLOAT))
    monkeypatch.setattr(packed, "INT16_MIN_M", 5)
    monkeypatch.setattr(packed, "INT8_MIN_M", 9)  # int8 from 9 rows, before int16 ...
    assert torch.equal(packed.linear(small, w, int8_ok=True), path(small, INT16))
    assert torch.equal(packed.linear(big, w, int8_ok=True), path(big, INT8))
    # ... only where the caller allows it (the default: not) and the weights are 4-bit
    assert torch.equal(packed.linear(big, w), path(big, INT16))
    w8, _ = quantize(random_weight(64, 128, seed=4), "Q8_0")
    assert torch.equal(
        packed.linear(big, w8, int8_ok=True), module.linear(big, w8.raw, w8.code, INT16)
    )
    bias = torch.randn(64)
    few = small[:4]  # float path: float32 rounding only
    torch.testing.assert_close(
        packed.linear(few, w, bias), few @ ref.T + bias, atol=1e-4, rtol=1e-4
    )
    # int16 path: activations to 16 bits (outputs here are ~10, their errors ~1e-3)
    torch.testing.assert_close(
        packed.linear(small, w, bias), small @ ref.T + bias, atol=1e-2, rtol=1e-3
    )
    with pytest.raises(RuntimeError, match="mode"):
        module.linear(big, w.raw, w.code, 3)


def test_decode_runs_the_integer_paths_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the int16 row kernel is faster than the float path at decode sizes on both ISAs
    # (bench/quant_linear.py --rows 1 --cold); STRUCTLLM_QUANT_INT16_MIN_M=0 keeps the
    # float path's exact weights everywhere
    monkeypatch.setattr(packed, "INT16_MIN_M", None)
    monkeypatch.setattr(packed, "INT8_MIN_M", 0)  # opted out: no int8 even where allowed
    assert packed.int16_min_m() == 1
    assert packed.block_mode(1) == INT16
    assert packed.block_mode(5, int8_ok=True) == INT16
    monkeypatch.setattr(packed, "INT8_MIN_M", 1)  # the default: where allowed, every size
    assert packed.block_mode(1) == INT16
    assert packed.block_mode(1, int8_ok=True) == INT8
    assert packed.block_mode(300, int8_ok=True) == INT8
    monkeypatch.setattr(packed, "INT16_MIN_M", 0)
    assert packed.block_mode(1) == FLOAT
    assert packed.block_mode(300) == FLOAT


def test_isa_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRUCTLLM_CPU_ISA", "avx2")
    assert cpu_ext.best_isa() == "avx2"
    assert cpu_ext.load_quant("avx2").isa() == "avx2"
    if "avx512" in ISAS:
        assert cpu_ext.load_quant("avx512").isa().startswith("avx512")
    monkeypatch.setenv("STRUCTLLM_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="STRUCTLLM_CPU_ISA"):
        cpu_ext.best_isa()


def test_rows_and_concatenation_keep_blocks_valid() -> None:
    a, ra = quantize(random_weight(8, 64, seed=4), "Q8_0")
    b, rb = quantize(random_weight(5, 64, seed=5), "Q8_0")
    both = BlockWeight.cat([a, b])
    assert both.shape == (13, 64)
    assert torch.equal(both.dequantize(), torch.cat([ra, rb]))
    ids = torch.tensor([12, 0, 3, 3])
    assert torch.equal(both.rows(ids), torch.cat([ra, rb])[ids])
