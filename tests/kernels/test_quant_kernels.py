"""The GGUF block kernels (``quant_linear.cpp``) against the float32 dequantisation.

Every block type (the k-quants as random super-blocks, held as the loader holds them,
against ``gguf``'s dequantisation of the file bytes), both ISA builds (the AVX2
one is forced on an AVX-512 machine by loading it explicitly), every path (float:
weights dequantised exactly, float32 math, in registers for a few rows and through a
blocked GEMM for more; int16 and int8: activations quantised per block), on random and
on the default model's weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from structllm.kernels import cpu_ext, packed
from structllm.kernels.packed import BLOCK_TYPES, FLOAT, INT8, INT16, BlockWeight, MixedWeight

gguf = pytest.importorskip("gguf")


def _available_isas() -> list[str]:
    flags = set(cpu_ext._cpu_flags().split())
    return [
        isa for isa, need in zip(cpu_ext.ISAS, cpu_ext._ISA_NEEDS, strict=True) if need <= flags
    ]


ISAS = _available_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="the block kernels need an AVX2/FMA/F16C CPU")
M_SIZES = [1, 3, 16, 64, 257]


K_QUANTS = list(packed.FILE_BYTES)  # gguf cannot quantise these: random super-blocks
RANDOM = [*K_QUANTS, "IQ4_NL"]  # nor these: random blocks
# the types held as super-blocks (IQ4_XS: its own kernels and tests, test_iquants.py)
TYPES = [t for t in BLOCK_TYPES if t not in packed.NATIVE_SUPER]
QUANTISABLE = [t for t in TYPES if t not in RANDOM]


def quantize(w: np.ndarray, type_name: str, seed: int = 0) -> tuple[BlockWeight, torch.Tensor]:
    """``w [N, K]`` float32 -> its blocks and their float32 dequantisation by ``gguf``.
    For a k-quant (which gguf only dequantises) random super-blocks of ``w``'s shape
    whose float16 scales are set to sizes like ``w``'s rows (every other byte random:
    all of it is valid quants and 6-bit scales)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "IQ4_NL":
        raw = random_iq4nl_blocks(w, seed)
    elif type_name in K_QUANTS:
        raw = random_super_blocks(w, type_name, seed)
    else:
        raw = gguf.quants.quantize(w, qtype)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(w.shape))
    return BlockWeight.from_raw(
        torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)), type_name, w.shape[1]
    ), ref


def random_super_blocks(w: np.ndarray, type_name: str, seed: int) -> np.ndarray:
    n, k = w.shape
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, packed.FILE_BYTES[type_name]), dtype=np.uint8)
    size = np.abs(w).reshape(n, k // 256, 256).max(axis=2)  # [n, super-blocks]

    def f16(a: np.ndarray) -> np.ndarray:
        return a.astype(np.float16).view(np.uint8).reshape(n, k // 256, 2)

    if type_name == "Q6_K":  # q in [-32, 31] times int8 scales: |w| up to ~4000 d
        raw[..., 208:210] = f16(size / 4000)
    else:  # q in [0, 31] times 6-bit scales, minus 6-bit mins times dmin
        raw[..., 0:2] = f16(size / 1000)
        raw[..., 2:4] = f16(size / 2000)
    return raw.reshape(n, -1)


def random_iq4nl_blocks(w: np.ndarray, seed: int) -> np.ndarray:
    """IQ4_NL blocks of ``w``'s shape: random nibbles (indices into the 16 levels, up to
    127 in size) under float16 scales sized like each block of ``w``."""
    n, k = w.shape
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 32, 18), dtype=np.uint8)
    size = np.abs(w).reshape(n, k // 32, 32).max(axis=2)
    raw[..., 0:2] = (size / 127).astype(np.float16).view(np.uint8).reshape(n, k // 32, 2)
    return raw.reshape(n, -1)


def width(type_name: str, blocks: int) -> int:
    """Columns for about ``blocks`` blocks of 32 (a k-quant: whole super-blocks)."""
    return 32 * blocks if type_name not in K_QUANTS else 256 * -(-blocks // 8)


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
@pytest.mark.parametrize("type_name", TYPES)
def test_float_path_weights_are_bit_exact(isa: str, type_name: str) -> None:
    """The float path's in-register dequantisation equals gguf's float32 dequantisation
    bit for bit: checked on the kernel's dequantiser and on the matmul itself, whose
    product with the identity is each weight times 1 plus zeros."""
    module = cpu_ext.load_quant(isa)
    w, ref = quantize(random_weight(40, width(type_name, 5)), type_name)
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
@pytest.mark.parametrize("type_name", TYPES)
def test_random_weights_match_the_float_reference(isa: str, type_name: str) -> None:
    w, ref = quantize(random_weight(72, width(type_name, 7), seed=1), type_name, seed=1)
    check_against_reference(cpu_ext.load_quant(isa), w, ref, seed=2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("blocks", [1, 7, 8, 9, 16, 18, 19, 48])
def test_decode_rows_int16_match_the_float_reference(isa: str, type_name: str, blocks: int) -> None:
    """The int16 row kernel (decode sizes, 1-8 rows) folds the scales of 8 blocks at a
    time and the last blocks of a row one by one: whole groups, tails, and rows shorter
    than a group, for every row count it serves."""
    w, ref = quantize(random_weight(40, width(type_name, blocks), seed=blocks), type_name, blocks)
    gen = torch.Generator().manual_seed(blocks)
    for m in (1, 2, 3, 4, 5, 8):
        x = torch.randn(m, w.shape[1], generator=gen)
        want = (x.double() @ ref.double().T).float()
        got = cpu_ext.load_quant(isa).linear(x, w.raw, w.code, INT16)
        assert ((got - want).norm() / want.norm()).item() < 1e-4, m
        row_rel = ((got - want).norm(dim=1) / want.norm(dim=1)).max().item()
        assert row_rel < 4e-4, m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("mode", [INT16, INT8])
@pytest.mark.parametrize("blocks", [7, 9, 18])
def test_a_rows_result_does_not_depend_on_the_batch(
    isa: str, type_name: str, mode: int, blocks: int
) -> None:
    """Bit for bit: a row's output is the same alone (the row kernel), with up to 7
    others (the row kernel at 2-8 rows, speculative verification; with VNNI Q4_K's and
    Q5_K's int8 path from 7 rows the blocked GEMM), or in a batch of 9 to
    17 (the 16-row kernels' passes up to 12 rows on the int16 path, 16 on the int8 one,
    or the blocked GEMM), on both integer paths and for the rows past the last group of 8
    (43 = 5 x 8 + 3). The activations are rounded by
    one quantiser and every output folds its blocks in one order, so a request's tokens
    do not depend on what else runs in its step."""
    w, _ = quantize(random_weight(43, width(type_name, blocks), seed=blocks), type_name, blocks)
    module = cpu_ext.load_quant(isa)
    x = torch.randn(17, w.shape[1], generator=torch.Generator().manual_seed(blocks))
    alone = torch.cat([module.linear(x[i : i + 1], w.raw, w.code, mode) for i in range(17)])
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17):
        assert torch.equal(module.linear(x[:m], w.raw, w.code, mode), alone[:m]), m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", QUANTISABLE)
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
    # (or 8-bit where VNNI makes that pay)
    assert torch.equal(packed.linear(big, w), path(big, INT16))
    w8, _ = quantize(random_weight(64, 128, seed=4), "Q8_0")
    eight = INT8 if packed.int8_pays_for_8_bit() else INT16
    assert torch.equal(
        packed.linear(big, w8, int8_ok=True), module.linear(big, w8.raw, w8.code, eight)
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


def test_fused_parts_of_different_types_run_each_in_its_own_type() -> None:
    """A fused q/k/v whose v is Q6_K and q/k Q4_K (as a Q4_K_M file has them) stays in
    blocks: one part per run of a type, each through its own kernels into its own
    output columns; row ranges (tensor parallelism) and column ranges cut across parts."""
    q, rq = quantize(random_weight(64, 512, seed=6), "Q4_K", seed=6)
    k, rk = quantize(random_weight(32, 512, seed=7), "Q4_K", seed=7)
    v, rv = quantize(random_weight(32, 512, seed=8), "Q6_K", seed=8)
    fused = BlockWeight.cat([q, k, v])
    assert isinstance(fused, MixedWeight)
    assert [(p.type_name, p.shape[0]) for p in fused.parts] == [("Q4_K", 96), ("Q6_K", 32)]
    assert fused.shape == (128, 512)
    assert packed.weight_bytes(fused) == q.nbytes + k.nbytes + v.nbytes
    ref = torch.cat([rq, rk, rv])
    assert torch.equal(fused.dequantize(), ref)
    x = torch.randn(5, 512)
    for int8_ok in (False, True):
        want = torch.cat([packed.linear(x, p, int8_ok=int8_ok) for p in fused.parts], dim=1)
        assert torch.equal(packed.linear(x, fused, int8_ok=int8_ok), want)
    want = x.double() @ ref.double().T  # int16 path: activations to 16 bits
    assert ((packed.linear(x, fused) - want).norm() / want.norm()).item() < 1e-4
    part = fused.row_range(48, 112)
    assert isinstance(part, MixedWeight) and torch.equal(part.dequantize(), ref[48:112])
    assert isinstance(fused.row_range(0, 90), BlockWeight) and not isinstance(
        fused.row_range(0, 90), MixedWeight
    )
    cols = fused.columns(256, 512)  # Q4_K is cut at its super-blocks of 256
    assert cols is not None and torch.equal(cols.dequantize(), ref[:, 256:512])
    assert fused.columns(32, 96) is None  # inside a Q4_K super-block
    assert fused.columns(16, 256) is None  # inside a block
    assert torch.equal(
        BlockWeight.cat([part, fused.row_range(0, 48)]).dequantize(),
        torch.cat([ref[48:112], ref[:48]]),
    )


def test_k_quants_keep_rows_and_need_whole_super_blocks() -> None:
    w, ref = quantize(random_weight(3, 768, seed=9), "Q5_K", seed=9)
    assert w.raw.shape == (3, 768 // 256 * packed.FILE_BYTES["Q5_K"])
    # every k-quant is held as the file's super-blocks: no byte more
    for name in packed.FILE_BYTES:
        k_w, _ = quantize(random_weight(2, 512, seed=9), name, seed=9)
        assert k_w.nbytes == 2 * 2 * packed.FILE_BYTES[name], name
    assert torch.equal(w.row_range(1, 2).dequantize(), ref[1:2])
    with pytest.raises(ValueError, match="Q4_K with 288 columns"):
        BlockWeight.from_raw(torch.zeros(144, dtype=torch.uint8), "Q4_K", 288)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1", "Q5_K"])
def test_int8_sums_of_5_bit_blocks_do_not_overflow(isa: str, type_name: str) -> None:
    """The largest 5-bit quants against the largest 8-bit activations: 32 * 31 * 127 per
    block, past int16, which vpmaddubsw's sums would wrap without the per-half widening
    (AVX2, AVX-512 without VNNI). The result must be the float reference's."""
    n, k = 24, 512
    if type_name == "Q5_K":
        raw = np.full((n * k // 256, packed.FILE_BYTES[type_name]), 0xFF, dtype=np.uint8)
        raw[:, 0:2] = np.array([1 / 64], dtype=np.float16).view(np.uint8)  # d, scales 63
        raw[:, 2:4] = 0  # dmin: no minimum
        ref = torch.full((n, k), 31 * 63 / 64)
    else:
        size = 22 if type_name == "Q5_0" else 24
        raw = np.full((n * k // 32, size), 0xFF, dtype=np.uint8)
        raw[:, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
        if type_name == "Q5_1":
            raw[:, 2:4] = 0  # m
        ref = torch.full((n, k), 15.0 if type_name == "Q5_0" else 31.0)  # Q5_0: q - 16
    w = BlockWeight.from_raw(raw, type_name, k)
    module = cpu_ext.load_quant(isa)
    assert torch.equal(module.dequantize(w.raw, w.code), ref)
    for m in (1, 16):
        x = torch.ones(m, k)
        for mode in (INT8, INT16):
            got = module.linear(x, w.raw, w.code, mode)
            torch.testing.assert_close(got, x @ ref.T, rtol=1e-5, atol=0)


@pytest.mark.parametrize("isa", ISAS)
def test_q8_0_int8_sums_at_the_extremes_are_exact(isa: str) -> None:
    """Q8_0's int8 GEMM (more rows than the row kernel's) at the quants' extremes: weights
    -128, -127 and 127 against activations of +-127 (each block's largest is 1 and every
    value +-1). With VNNI the weights are held as q + 128 (up to 255) and each block's
    sum starts from -128 sum(x); without it, |q| times x with q's sign, whose pairs
    (2 * 128 * 127) stay under vpmaddubsw's saturation. Either way the integer sums are
    exact: the result is the float64 one to float32 rounding, at every row count, and
    each row's is the same alone as in a batch."""
    n, k = 40, 256
    rng = np.random.default_rng(7)
    raw = np.zeros((n, k // 32, 34), dtype=np.uint8)
    raw[..., 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    q = rng.choice(np.array([-128, -127, 127], dtype=np.int8), (n, k // 32, 32))
    raw[..., 2:] = q.view(np.uint8)
    w = BlockWeight.from_raw(raw.reshape(n, -1), "Q8_0", k)
    ref = torch.from_numpy(q.reshape(n, k).astype(np.float64))
    module = cpu_ext.load_quant(isa)
    x = torch.from_numpy(rng.choice(np.array([-1.0, 1.0], dtype=np.float32), (70, k)))
    alone = torch.cat([module.linear(x[i : i + 1], w.raw, w.code, INT8) for i in range(70)])
    for m in (1, 17, 33, 70):
        got = module.linear(x[:m], w.raw, w.code, INT8)
        torch.testing.assert_close(got.double(), x[:m].double() @ ref.T, rtol=1e-6, atol=1e-4)
        assert torch.equal(got, alone[:m]), m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("blocks", [3, 24, 96])
def test_q8_0_int8_rows_do_not_depend_on_the_batch_at_prompt_sizes(isa: str, blocks: int) -> None:
    """Q8_0 on the int8 path: a row's output is the same alone (the row kernel) as in a
    batch of 64 or 257 (the blocked GEMM: whole register tiles, a padded last vector, and
    at 96 blocks two chunks of K), bit for bit."""
    w, _ = quantize(random_weight(37, 32 * blocks, seed=blocks), "Q8_0", blocks)
    module = cpu_ext.load_quant(isa)
    x = torch.randn(257, w.shape[1], generator=torch.Generator().manual_seed(blocks))
    big = module.linear(x, w.raw, w.code, INT8)
    for i in (0, 1, 15, 16, 17, 100, 256):
        assert torch.equal(module.linear(x[i : i + 1], w.raw, w.code, INT8), big[i : i + 1]), i
    assert torch.equal(module.linear(x[:64], w.raw, w.code, INT8), big[:64])


# ---------------------------------------------------------------------------------------
# float16 rows (packed.HalfMatrix, type code F16_CODE): a float16/bfloat16 checkpoint's
# experts


def half_rows(n: int, k: int, seed: int) -> packed.HalfMatrix:
    g = torch.Generator().manual_seed(seed)
    return packed.HalfMatrix((torch.randn(n, k, generator=g) * 0.05).half())


@pytest.mark.parametrize("isa", ISAS)
def test_float16_rows_match_a_float64_reference(isa: str) -> None:
    """Every mode runs the one float16 kernel; each element is within the bound of any
    float32 summation of its K products, ``K * 2**-24 * sum |x_k w_k|`` (the weights
    widened exactly: the dequantisation is the float16 values themselves). K = 48 and
    200: a tail shorter than a vector."""
    module = cpu_ext.load_quant(isa)
    g = torch.Generator().manual_seed(1)
    for m, n, k in [(1, 37, 1024), (3, 16, 48), (16, 50, 200), (64, 9, 64)]:
        w = half_rows(n, k, seed=k)
        x = torch.randn(m, k, generator=g) * 4
        assert torch.equal(module.dequantize(w.raw, w.code), w.half().float())
        ref = x.double() @ w.half().double().T
        bound = k * 2.0**-24 * (x.double().abs() @ w.half().double().abs().T)
        got = module.linear(x, w.raw, w.code, FLOAT)
        assert ((got.double() - ref).abs() <= bound).all(), (m, n, k)
        for mode in (INT8, INT16):
            assert torch.equal(module.linear(x, w.raw, w.code, mode), got)
        if isa == cpu_ext.best_isa():  # linear's dispatch runs this build
            assert torch.equal(packed.linear(x, w, int8_ok=True), got)


@pytest.mark.parametrize("isa", ISAS)
def test_float16_rows_are_batch_invariant(isa: str) -> None:
    """A row's outputs are bit for bit the same with 1, 3, 16 or 64 rows beside it, and
    however the weight rows are cut (what cpu_moe.cpp's items do)."""
    module = cpu_ext.load_quant(isa)
    w = half_rows(75, 1000, seed=4)  # 75 rows: no multiple of a panel; 1000: a tail
    x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(5))
    full = module.linear(x, w.raw, w.code, FLOAT)
    for m in (1, 3, 16, 64):
        assert torch.equal(module.linear(x[:m].clone(), w.raw, w.code, FLOAT), full[:m]), m
    for r in (0, 17, 63):
        assert torch.equal(
            module.linear(x[r : r + 1].clone(), w.raw, w.code, FLOAT), full[r : r + 1]
        )
    for a, b in [(0, 8), (8, 40), (3, 5), (40, 75)]:
        part = w.row_range(a, b)
        assert torch.equal(module.linear(x, part.raw.contiguous(), w.code, FLOAT), full[:, a:b])


def test_float16_rows_are_as_accurate_as_fbgemm() -> None:
    """The same float16 weights through fbgemm's packed kernel (the path these weights
    took before): the mean error against float64 is no larger (both sum float32
    products; only the order differs)."""
    if not packed.half_linear_available():
        pytest.skip("no fbgemm float16 linear in this torch build")
    w = half_rows(512, 1024, seed=6)
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(7))
    ref = x.double() @ w.half().double().T
    ours = (packed.linear(x, w).double() - ref).abs().mean()
    fbgemm = (packed.linear(x, packed.HalfWeight(w.half())).double() - ref).abs().mean()
    assert ours <= 1.25 * fbgemm, (ours, fbgemm)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (gguf's, 2^127 * 12)
@pytest.mark.parametrize("isa", ISAS)
def test_mxfp4_every_exponent_is_ggml_s(isa: str) -> None:
    """MXFP4 (gpt-oss's experts): every E8M0 exponent byte, the two denormal scales
    (bytes 0 and 1) and the largest included, with random nibbles, dequantise bit for
    bit as ggml's (the gguf package's), on the kernel's dequantiser and the float path."""
    module = cpu_ext.load_quant(isa)
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (8, 32, 17), dtype=np.uint8)  # 8 rows of 32 blocks
    raw[..., 0] = np.arange(256, dtype=np.uint8).reshape(8, 32)
    qtype = gguf.GGMLQuantizationType.MXFP4
    ref = torch.from_numpy(gguf.quants.dequantize(raw.reshape(8, -1), qtype).astype(np.float32))
    w = BlockWeight.from_raw(torch.from_numpy(raw.reshape(8, -1)), "MXFP4", 32 * 32)
    assert torch.equal(module.dequantize(w.raw, w.code), ref)
    # the matmul on the rows whose exponents stay finite in products (up to 191; from
    # about 254 a weight is infinite, and 0 times it NaN)
    rows, finite = torch.eye(32 * 32)[:3], w.row_range(0, 6)
    got = module.linear(rows, finite.raw.contiguous(), w.code, FLOAT)
    assert torch.equal(got, ref[:6, :3].T.contiguous())


@pytest.mark.parametrize("mode_name", packed.CPU_ACTIVATIONS)
def test_cpu_activations_picks_the_kernel_path(
    mode_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--cpu-activations``: bit for bit the path it names, at decode and GEMM sizes.
    auto: int8 where allowed for 4/5-bit weights (Q8_0 too where VNNI makes it pay),
    int16 elsewhere; int16: int16 everywhere; int8: int8 where allowed, Q8_0 too."""
    monkeypatch.setattr(packed, "INT8_MIN_M", 1)  # auto's default, whatever the environment
    monkeypatch.setattr(packed, "INT16_MIN_M", None)
    monkeypatch.setattr(packed, "_ACTIVATIONS", "auto")
    packed.set_cpu_activations(mode_name)
    module = cpu_ext.load_quant()
    eight = INT8 if packed.int8_pays_for_8_bit() else INT16  # auto's path for Q8_0
    want = {  # (type, int8_ok) -> path
        "auto": {("Q4_1", True): INT8, ("Q8_0", True): eight, ("Q4_1", False): INT16},
        "int16": {("Q4_1", True): INT16, ("Q8_0", True): INT16, ("Q4_1", False): INT16},
        "int8": {("Q4_1", True): INT8, ("Q8_0", True): INT8, ("Q4_1", False): INT16},
    }[mode_name]
    for (type_name, int8_ok), mode in want.items():
        w, _ = quantize(random_weight(64, 128, seed=5), type_name)
        for rows in (1, 9, 40):
            x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
            got = packed.linear(x, w, int8_ok=int8_ok)
            assert torch.equal(got, module.linear(x, w.raw, w.code, mode)), (type_name, rows)
            other = INT16 if mode == INT8 else INT8
            if int8_ok and type_name in packed.INT8_KERNEL_TYPES:  # the paths do differ
                assert not torch.equal(got, module.linear(x, w.raw, w.code, other))
    with pytest.raises(ValueError, match="cpu_activations"):
        packed.set_cpu_activations("int4")


def test_auto_runs_q8_0_on_int8_only_where_vnni_makes_it_pay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under ``auto`` an ``int8_ok`` Q8_0 matmul takes the int8 path on an AVX-512 VNNI
    build (``int8_pays_for_8_bit``) and the int16 one elsewhere; without ``int8_ok``, or
    under ``int16``, it never does."""
    module = packed._kernels()
    w, _ = quantize(random_weight(48, 128, seed=8), "Q8_0")
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(8))
    int8, int16 = (module.linear(x, w.raw, w.code, m) for m in (INT8, INT16))
    assert not torch.equal(int8, int16)
    vnni = module.isa() == "avx512-vnni"
    assert packed.int8_pays_for_8_bit() == vnni
    try:
        packed.set_cpu_activations("auto")
        monkeypatch.setattr(packed, "INT8_MIN_M", 1)
        assert torch.equal(packed.linear(x, w, int8_ok=True), int8 if vnni else int16)
        assert torch.equal(packed.linear(x, w), int16)
        packed.set_cpu_activations("int16")
        assert torch.equal(packed.linear(x, w, int8_ok=True), int16)
    finally:
        packed.set_cpu_activations("auto")
