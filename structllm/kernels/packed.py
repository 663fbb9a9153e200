"""Packed matmul weights and the ``linear`` that runs them: ``y = x @ W^T (+ b)``.

A weight ``W [N, K]`` is one of:
- a plain tensor (any dtype, any device): ``F.linear``;
- a oneDNN-packed float32 tensor (``is_mkldnn``, see ``LlamaModel.pack_weights``);
- ``HalfWeight``: float16 packed for fbgemm's ``linear_dynamic_fp16`` (CPU): half the
  bytes of float32, float32 activations and accumulation;
- ``BlockWeight``: GGUF blocks run by the C++ kernels of ``quant_linear.cpp`` (CPU,
  AVX2 or AVX-512): Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and the k-quants Q4_K, Q5_K, Q6_K
  (super-blocks of 256, see cpu_kquants.h) as laid in the file, bit-exact to ggml's
  dequantisation; IQ4_NL as laid in the file (Q4_0's
  layout, each nibble an index into ggml's 16 non-linear levels); MXFP4 likewise (an
  E8M0 exponent byte, then the nibbles: E2M1 values; gpt-oss's experts); IQ4_XS as
  laid in the file (super-blocks of 256: IQ4_NL's levels under 6-bit sub-block scales,
  ``cpu_iquants.h``; a float and an int8 path, its int16 mode running the int8 one);
- ``MixedWeight``: a fused matrix (q/k/v, gate/up) whose parts the file stores in
  different block types: each part runs in its own type, into its own output columns;
- ``HalfMatrix``: float16 rows as stored, run by quant_linear.cpp's own float16 kernel
  (batch-invariant, which fbgemm's is not): a float16/bfloat16 checkpoint's experts.

Activations are float32 for the last three. ``BlockWeight`` picks the kernel path by the
number of rows ``M`` of ``x`` (see ``block_mode``): the float path (weights dequantised
in registers, bit-exact to the float32 dequantisation, float32 math), from
``INT16_MIN_M`` rows on the int16 path (activations rounded to 16 bits per block of 32,
integer dot products of pairs), and the int8 path (8 bits per block: faster, less exact)
for the matmuls whose caller allows it (the MLP's) where the weights are 4- or 5-bit
(``INT8_TYPES``), or 8-bit where the kernels have VNNI (``int8_types``; from
``INT8_MIN_M`` rows; on by default, ``STRUCTLLM_QUANT_INT8_MIN_M=0`` keeps 16 bits).
The user picks among them with ``--cpu-activations auto|int8|int16``
(``set_cpu_activations``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

# the kernel's type codes
BLOCK_TYPES = {
    "Q4_0": 0,
    "Q4_1": 1,
    "Q8_0": 2,
    "Q5_0": 3,
    "Q5_1": 4,
    "Q4_K": 5,
    "Q5_K": 6,
    "Q6_K": 7,
    "IQ4_NL": 8,
    "MXFP4": 10,  # (9: float16 rows, F16_CODE)
    "IQ4_XS": 11,
}
# bytes per 32 weights as the kernels hold them, all as in the file (the types held as
# super-blocks of 256: their bytes / 8, Q6_K's 210 / 8 no whole number: see ``row_bytes``)
BLOCK_BYTES: dict[str, float] = {
    "Q4_0": 18,
    "Q4_1": 20,
    "Q8_0": 34,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q4_K": 18,  # 144 bytes per super-block of 256
    "Q5_K": 22,  # 176
    "Q6_K": 26.25,  # 210
    "IQ4_NL": 18,
    "MXFP4": 17,
    "IQ4_XS": 17,  # 136 bytes a super-block of 256, held as in the file
}
BLOCK = 32
# quant_linear.cpp's code for float16 rows (``HalfMatrix``), after the GGUF types; not in
# BLOCK_TYPES, which names the file types that load as blocks
F16_CODE = 9
# the k-quants: super-blocks of SUPER weights, FILE_BYTES bytes each in the file
SUPER = 256
FILE_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
# the types held as the file's super-blocks of SUPER weights (cpu_iquants.h): a matrix's
# columns are whole super-blocks, and the kernels' int16 mode runs 8-bit activations
NATIVE_SUPER = frozenset({"IQ4_XS"})


def granule(type_name: str) -> int:
    """The columns a weight of ``type_name`` is cut at: its super-block (the k-quants,
    whose scales come from the super-block, and the types held as super-blocks) or its
    block of 32."""
    return SUPER if type_name in FILE_BYTES or type_name in NATIVE_SUPER else BLOCK


def held_as_super(type_name: str) -> bool:
    """Whether the kernels hold ``type_name`` as the file's super-blocks of SUPER weights
    (IQ4_XS and the k-quants), so a column cut must fall between super-blocks."""
    return type_name in NATIVE_SUPER or type_name in FILE_BYTES


def row_bytes(type_name: str, k: int) -> int:
    """Bytes of ``k`` weights (whole granules) of ``type_name`` as the kernels hold them:
    the file's bytes for every type."""
    if held_as_super(type_name):
        return k // SUPER * int(BLOCK_BYTES[type_name] * (SUPER // BLOCK))
    return k // BLOCK * int(BLOCK_BYTES[type_name])


# Kernel paths (the C++ ``linear``'s mode codes).
FLOAT, INT8, INT16 = 0, 1, 2

# Rows of x from which the int16 path runs (0: never; unset: 1, see int16_min_m).
# Many rows make the matmul bound by arithmetic, and the float path, however blocked, is
# then held to the float32 FMA rate, the rate oneDNN's packed float32 already runs at
# (0.85-0.95x of it at M = 16-256 on a 2-vCPU AVX-512 EPYC, bench/quant_linear.py). The
# int16 path does 32 multiply-adds per instruction (vpdpwssd; vpmaddwd + vpaddd on AVX2)
# against the FMA's 16: 1.1-1.6x oneDNN's speed at M = 16-256 on AVX-512, 1.2-1.4x on
# the AVX2 build against oneDNN held to AVX2. Activations rounded to 16 bits per block of
# 32 (relative error <= 2^-16 of the block's largest value) leave greedy top-1 agreement
# with float32 where the float path's is (tests/engine/test_quant_model.py).
_INT16_ENV = os.environ.get("STRUCTLLM_QUANT_INT16_MIN_M")
INT16_MIN_M: int | None = int(_INT16_ENV) if _INT16_ENV else None


def int16_min_m() -> int:
    """``INT16_MIN_M`` if set, else 1: the int16 path at every size. Decode sizes (1-8
    rows) run its row kernel, which reads each weight block once for all rows and folds
    8 blocks' scales at a time; at one row it ran the default model's Q4_1 matmuls
    1.4-1.6x faster than the float path on a 2-vCPU AVX-512 EPYC (weights cold in
    cache, bench/quant_linear.py --rows 1 --cold), where the float path, though it
    dequantises a 4-bit block through a 16-entry table, converts each block's scales
    one by one. ``STRUCTLLM_QUANT_INT16_MIN_M=0`` keeps the float path (float32
    activations, weights exactly the float32 dequantisation) at every size."""
    if _ACTIVATIONS == "int16":
        return 1
    if INT16_MIN_M is not None:
        return INT16_MIN_M
    return 1


# Rows of x from which the int8 path runs (0: never), for the matmuls whose caller says
# they tolerate it (``linear(..., int8_ok=True)``: the MLP's gate/up and down) and whose
# weights are 4-bit. Activations rounded to 8 bits per block of 32, as llama.cpp does
# for every quantised matmul. For Q4 weights from 9 rows a blocked GEMM of u8 x s8
# products (vpmaddubsw, or VNNI's vpdpbusd), 1.3-1.6x the int16 GEMM's speed at 5-160
# rows on the AVX2 build (two threads; 1.35-1.6x one thread with AVX-512 VNNI); at 1-8
# rows the int16 path's row kernel over int8 activations, within 0-15% of its speed.
# Both integer paths are batch-invariant: activations are rounded by one quantiser, and
# the row kernel folds every output's blocks in the blocked GEMM's order, so a row's
# result is bit for bit the same at any row count (tests/kernels/test_quant_kernels.py,
# and tests/engine/test_quant_model.py for whole requests, int8 MLP included). An
# earlier row kernel summed in another order; the last-bit differences it left were
# absorbed by 16-bit rounding but not by 8-bit, and greedy tokens under load then
# differed from those of the same request alone, which kept this path off by default.
# Now it is on by default (AVX2 build, concurrency 16: 2.24-2.50x llama.cpp's tokens/s
# against 2.0x with 16 bits, same day); STRUCTLLM_QUANT_INT8_MIN_M=0 keeps the int16 path, the
# closer to float32 of the two.
# What the 8 bits cost, teacher-forced top-1 agreement with float32 of the same weights
# over 32 chats x 40 tokens (tests/engine/test_quant_model.py): int8 in the MLP only,
# 98.2% for Q4_1, 97.6% for Q4_0 (the int16 path: 99.8-100%), within the 97% bar
# for 4-bit formats; int8 in every layer matmul (16 chats), 97.3% / 95.9% (q/k/v alone:
# 97.7% / 98.4%).
# The MLP holds three quarters of a layer's multiply-adds, so it keeps most of the gain.
# Q8_0 weights (and the Q8_0 matrices of k-quant files) take the int8 path too where
# the kernels have VNNI (``int8_pays_for_8_bit``), as llama.cpp rounds every matmul's
# activations to 8 bits: issue 46's bar judges accuracy against llama.cpp on the same
# file, not against 99% top-1 agreement (which had kept them on int16). With the MLP in
# int8, on the default model's requantised files (bench/accuracy.py --windows 2 --paths
# int8, KL from the file's float model / top-1; llama.cpp's in brackets): Q8_0 1.0e-3 /
# 98.0% [2.9e-3 / 96.3%], Q6_K 7.5e-4 / 97.8% [4.0e-3 / 95.9%], Q4_K_M 8.2e-4 / 98.6%
# [3.8e-3 / 96.9%]. With VNNI the int8 kernels run Q8_0 1.3-1.6x faster than the int16
# ones from 2 rows (bench/q8_0_prompt.py); without it (vpmaddubsw needs the sign trick)
# at best even, so AVX2 keeps 16 bits for them. The LM head stays on int16 (see
# ``LlamaModel.compute_logits``), and so do the q/k/v projections (int8_ok unset); the
# output projection takes int8 (``DecoderLayer.O_INT8``).
INT8_MIN_M = int(os.environ.get("STRUCTLLM_QUANT_INT8_MIN_M", "1"))
# So do Q4_K (unsigned nibbles with a minimum, as Q4_1), the 5-bit types (Q5_0 is most
# matrices of a small model's Q4_K_M file) and Q6_K (the ffn_down of half a Q4_K_M file's
# layers; its signed 6-bit quants as |q| x (x with q's sign) in the row kernels, as q + 32
# against sum q x - 32 sum x in the blocked GEMM: cpu_kquants.h, cpu_gemm.h's micro_q6).
INT8_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"})


ROW_KERNEL_ROWS = (
    8  # quant_linear.cpp's MT_Q (AVX-512 build; 5 on AVX2): rows that read each block once
    # (AVX-512 VNNI: Q4_0/Q4_1/Q8_0 up to 16 rows in passes of 8, on the int16 path up
    # to 12; Q4_K/Q5_K on the int8 path up to 6: see rows_max_m, rows_max_m_int16,
    # kq_rows_max_int8)
)


# The user's choice (``--cpu-activations``, ``EngineConfig.cpu_activations``), set once
# per engine process by ``set_cpu_activations``:
# - ``auto`` (the default): as above, int8 in the MLP's matmuls of ``INT8_TYPES`` weights,
#   the int16 path elsewhere (and the ``STRUCTLLM_QUANT_*_MIN_M`` overrides for tuning);
# - ``int16``: 16-bit activations in every block matmul, at every row count: the closer
#   to float32 (bench/accuracy.py), the slower on many rows;
# - ``int8``: 8-bit activations in the MLP's matmuls of every type the int8 kernels run
#   (``INT8_KERNEL_TYPES``: Q8_0 weights too, as llama.cpp does), at every row count.
CPU_ACTIVATIONS = ("auto", "int8", "int16")
# quant_linear.cpp's int8_path: every block type but Q6_K and the table types
INT8_KERNEL_TYPES = INT8_TYPES | {"Q8_0"}
_ACTIVATIONS = "auto"


def set_cpu_activations(mode: str) -> None:
    """Set this process's activation precision (one of ``CPU_ACTIVATIONS``); models
    built afterwards take their native plans' int8 choices from it."""
    global _ACTIVATIONS
    if mode not in CPU_ACTIVATIONS:
        raise ValueError(f"cpu_activations must be auto, int8 or int16, got {mode!r}")
    _ACTIVATIONS = mode


def int8_min_m() -> int:
    """Rows from which ``int8_ok`` matmuls take the int8 path (0: never)."""
    if _ACTIVATIONS == "auto":
        return INT8_MIN_M
    return 1 if _ACTIVATIONS == "int8" else 0


_EIGHT_BIT_PAYS: bool | None = None  # int8_pays_for_8_bit's answer, once asked


def int8_pays_for_8_bit() -> bool:
    """Whether the int8 path is the faster one for Q8_0 weights: with AVX-512 VNNI its
    row kernel took 0.68-0.79x the int16 one's time at 2-8 rows and its blocked GEMM
    0.6-0.72x at 12-380 rows; on AVX2 the GEMM took 1.02-1.1x (bench/q8_0_prompt.py, one
    thread), where ``vpmaddubsw`` needs the sign trick and a widening per quad."""
    global _EIGHT_BIT_PAYS
    if _EIGHT_BIT_PAYS is None:
        _EIGHT_BIT_PAYS = bool(_kernels().isa() == "avx512-vnni")
    return _EIGHT_BIT_PAYS


def int8_types() -> frozenset[str]:
    """The weight types whose ``int8_ok`` matmuls may take the int8 path: under ``auto``
    Q8_0 too where that pays (``int8_pays_for_8_bit``), under ``int8`` always."""
    if _ACTIVATIONS == "int8" or (_ACTIVATIONS == "auto" and int8_pays_for_8_bit()):
        return INT8_KERNEL_TYPES
    return INT8_TYPES


def block_mode(rows: int, int8_ok: bool = False) -> int:
    """The kernel path for ``rows`` rows of activations (``int8_ok``: the caller allows
    the int8 path, and the weights are of an ``int8_types()`` type)."""
    if int8_ok and 0 < int8_min_m() <= rows:
        return INT8
    if 0 < int16_min_m() <= rows:
        return INT16
    return FLOAT


_KERNELS: Any = None  # the loaded module, once found (linear runs ~150 times a step)


def _kernels() -> Any:
    global _KERNELS
    if _KERNELS is None:
        from structllm.kernels import cpu_ext

        module = cpu_ext.load_quant()
        if module is None:
            raise RuntimeError(
                "the GGUF block kernels are unavailable on this machine (see the log)"
            )
        _KERNELS = module
    return _KERNELS


def _k_scales(sb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks ``[n, bytes]`` -> the 8 sub-blocks' 6-bit scales and
    minima ``[n, 8]`` uint8, unpacked from the 12 scale bytes (ggml's get_scale_min_k4)."""
    s = sb[:, 4:16].reshape(-1, 3, 4)
    lo, hi, both = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mn = np.concatenate([hi & 0x3F, (both >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return sc, mn


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """Quants ``[..., 32]`` (< 16) -> 16 bytes, weight j low and weight j + 16 high."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """A k-quant's 128 nibble bytes ``[n, 128]`` -> 8 sub-blocks' low 4 bits ``[n, 8,
    32]``: bytes 32j..32j+31 hold sub-block 2j in their low nibbles, 2j+1 in the high."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def _bytes(a: np.ndarray, n: int) -> np.ndarray:
    """``[n_super, 8, ...]`` of any dtype -> its bytes ``[n_super, 8, w]``."""
    return np.ascontiguousarray(a).view(np.uint8).reshape(n, 8, -1)


def _per_block(b: np.ndarray) -> np.ndarray:
    """A super-block's bytes ``[n, w]`` repeated for its 8 blocks: ``[n, 8, w]``."""
    return np.repeat(b[:, None, :], 8, axis=1)


def repack(raw: np.ndarray, type_name: str) -> np.ndarray:
    """A k-quant tensor's file bytes (super-blocks of 256 weights, ggml-common.h) ->
    self-contained blocks of 32 as the kernels held them, ``[n_super * 8, 22 / 26 / 28]``
    uint8, in the same order (so rows of the matrix stay rows, and columns cut at any
    32):

    - Q4_K ``[D | DMIN | sc u8 | mn u8 | 16 nibble bytes]``: w = q * d + m;
    - Q5_K ``[D | DMIN | sc u8 | mn u8 | qh u32 | 16 nibble bytes]``: w = (q | h << 4) *
      d + m;
    - Q6_K ``[D | sc0 i8 | sc1 i8 | 16 nibble bytes | 8 bytes of high bits]``: w = (q -
      32) * d0 (first 16), (q - 32) * d1 (last 16), q = nibble | high two bits << 4;

    D, DMIN: the super-block's float16 scales, repeated; the kernels form d = D * sc,
    m = -(DMIN * mn), d0 = D * sc0 in float32 (exact: a float16 times a 6- or 8-bit
    integer), as ggml's dequantisation does, so ``q * d + m`` rounds as its ``d * q -
    dm``. 22/26/28 bytes per 32 weights against the file's 18/22/26.25. No type is held
    so any more: the k-quants are held as the file's super-blocks and read in place by
    every path (cpu_kquants.h); these blocks are what they were held as before, the
    baseline ``bench/q4k_layout.py`` runs against."""
    sb = raw.reshape(-1, FILE_BYTES[type_name])
    n = sb.shape[0]
    if type_name == "Q6_K":
        shift4 = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        shift2 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        ql = ((sb[:, :128].reshape(-1, 2, 1, 64) >> shift4) & 0x0F).reshape(-1, 8, 32)
        qh = ((sb[:, 128:192].reshape(-1, 2, 1, 32) >> shift2) & 0x03).reshape(-1, 8, 32)
        # high bits of weight 8i + j -> bits 2i, 2i + 1 of byte j
        hi = qh.reshape(n, 8, 4, 8) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        qh2 = np.bitwise_or.reduce(hi, axis=2).astype(np.uint8)  # [n, 8, 8]
        out = [
            _per_block(sb[:, 208:210]),
            _bytes(sb[:, 192:208].reshape(n, 8, 2), n),
            _nibble_pairs(ql),
            qh2,
        ]
    else:
        sc, mn = _k_scales(sb)
        head = [_per_block(sb[:, 0:4]), _bytes(np.stack([sc, mn], axis=2), n)]
        if type_name == "Q4_K":
            out = [*head, _bytes(_nibble_pairs(_k_nibbles(sb[:, 16:144])), n)]
        else:  # Q5_K: fifth bits in qh[32] (bit s of byte l: sub-block s, weight l)
            hb = (sb[:, None, 16:48] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            qh32 = (hb.astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(
                axis=2, dtype=np.uint32
            )
            nib = _nibble_pairs(_k_nibbles(sb[:, 48:176]))
            out = [*head, _bytes(qh32, n), _bytes(nib, n)]
    return np.concatenate(out, axis=2).reshape(n * 8, -1)


@dataclass
class BlockWeight:
    """``[N, K]`` weight as GGUF blocks: ``raw [N, K/32 * block_bytes]`` uint8 (rows are
    independent, so row slices and concatenations stay valid)."""

    raw: Tensor
    type_name: str
    shape: tuple[int, int]
    code: int = field(init=False)  # the kernel's type code (BLOCK_TYPES)

    def __post_init__(self) -> None:
        self.code = BLOCK_TYPES.get(self.type_name, -1)

    @classmethod
    def from_raw(cls, raw: Tensor | np.ndarray, type_name: str, k: int) -> BlockWeight:
        """From a tensor's bytes as stored in a GGUF file (held as they are)."""
        if type_name not in BLOCK_TYPES or k % granule(type_name):
            raise ValueError(f"not a supported block weight: {type_name} with {k} columns")
        if not isinstance(raw, Tensor):
            raw = torch.from_numpy(np.array(raw).view(np.uint8))  # a copy: writable, owned
        raw = raw.reshape(-1, row_bytes(type_name, k)).contiguous()
        return cls(raw, type_name, (raw.shape[0], k))

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def dequantize(self) -> Tensor:
        """``[N, K]`` float32, bit-identical to the reference dequantisation."""
        return _kernels().dequantize(self.raw, self.code)

    def rows(self, ids: Tensor) -> Tensor:
        """Rows ``ids [T]`` dequantised, ``[T, K]`` float32 (an embedding lookup)."""
        return _kernels().dequantize(self.raw.index_select(0, ids), self.code)

    def select_rows(self, rows: Tensor) -> BlockWeight:
        """Rows ``rows`` (in that order) as a new ``BlockWeight``."""
        return BlockWeight(
            self.raw.index_select(0, rows).contiguous(), self.type_name, (len(rows), self.shape[1])
        )

    def row_range(self, a: int, b: int) -> BlockWeight:
        """Rows ``a .. b`` (a view)."""
        return BlockWeight(self.raw[a:b], self.type_name, (b - a, self.shape[1]))

    def columns(self, a: int, b: int) -> BlockWeight | None:
        """Columns ``a .. b`` as a weight of its own (whole blocks of 32; the k-quants,
        IQ4_XS: whole super-blocks), or None when a bound falls inside one."""
        g = SUPER if held_as_super(self.type_name) else BLOCK
        if a % g or b % g:
            return None
        t = self.type_name
        raw = self.raw[:, row_bytes(t, a) : row_bytes(t, b)].contiguous()
        return BlockWeight(raw, self.type_name, (self.shape[0], b - a))

    def owned(self) -> BlockWeight:
        """A copy that holds its own bytes (not a view of a larger weight's)."""
        return BlockWeight(self.raw.clone(), self.type_name, self.shape)

    def formats(self) -> list[tuple[str, int]]:
        """``(type, rows)`` of its parts (one part: itself), for the start-up report."""
        return [(self.type_name, self.shape[0])]

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight:
        """Row concatenation: a ``BlockWeight`` when all parts are of one type, else a
        ``MixedWeight`` of runs of one type (never dequantised)."""
        k = parts[0].shape[1]
        assert all(p.shape[1] == k for p in parts)
        flat = [q for p in parts for q in (p.parts if isinstance(p, MixedWeight) else [p])]
        runs: list[list[BlockWeight]] = []
        for p in flat:
            if runs and runs[-1][0].type_name == p.type_name:
                runs[-1].append(p)
            else:
                runs.append([p])
        joined = []
        for run in runs:
            raw = torch.cat([p.raw for p in run]) if len(run) > 1 else run[0].raw
            joined.append(BlockWeight(raw, run[0].type_name, (raw.shape[0], k)))
        return joined[0] if len(joined) == 1 else MixedWeight(joined)


_FP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # kvalues_mxfp4


def mxfp4_values(w: BlockWeight) -> Tensor:
    """An MXFP4 ``BlockWeight``'s ``[N, K]`` float32 values in plain torch (any machine,
    no kernel): ggml's ``kvalues_mxfp4[q] * 2^(e - 128)``, exact in float32 (for the
    exact path, and devices the block kernels do not run on)."""
    n, k = w.shape
    raw = w.raw.reshape(n, k // BLOCK, 17)
    e = raw[..., :1].to(torch.int32)  # [N, G, 1]
    # ggml_e8m0_to_fp32_half as float bits: 2^(e - 128), the denormals 2^-128, 2^-127 for e < 2
    bits = torch.where(
        e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x200000), e), (e - 1) << 23
    )
    scale = bits.view(torch.float32)
    q = raw[..., 1:].to(torch.int64)
    codes = torch.cat([q & 0x0F, q >> 4], dim=-1)  # [N, G, 32]: element j, then j + 16
    levels = torch.tensor(_FP4_DOUBLED, dtype=torch.float32)[codes]
    return (levels * scale).reshape(n, k)


class MixedWeight(BlockWeight):
    """``[N, K]`` as consecutive row parts in different block types: a fused q/k/v or
    gate/up whose parts a file stores in different types (a Q4_K_M file: q/k Q4_K, v
    Q6_K). ``linear`` runs each part in its own type and kernels, into its own output
    columns; nothing is dequantised."""

    def __init__(self, parts: list[BlockWeight]) -> None:
        self.parts = parts
        k = parts[0].shape[1]
        super().__init__(
            torch.empty(0, dtype=torch.uint8),
            "+".join(p.type_name for p in parts),
            (sum(p.shape[0] for p in parts), k),
        )

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def rows(self, ids: Tensor) -> Tensor:
        return self.dequantize().index_select(0, ids)

    def _split_at(self) -> list[int]:
        starts, n = [], 0
        for p in self.parts:
            starts.append(n)
            n += p.shape[0]
        return starts

    def select_rows(self, rows: Tensor) -> BlockWeight:
        return BlockWeight.cat([self.row_range(int(r), int(r) + 1) for r in rows])

    def row_range(self, a: int, b: int) -> BlockWeight:
        pieces = []
        for start, p in zip(self._split_at(), self.parts, strict=True):
            lo, hi = max(a, start), min(b, start + p.shape[0])
            if lo < hi:
                pieces.append(p.row_range(lo - start, hi - start))
        return BlockWeight.cat(pieces)

    def columns(self, a: int, b: int) -> BlockWeight | None:
        cols = [p.columns(a, b) for p in self.parts]
        if any(c is None for c in cols):
            return None
        return BlockWeight.cat([c for c in cols if c is not None])

    def owned(self) -> BlockWeight:
        return MixedWeight([p.owned() for p in self.parts])

    def formats(self) -> list[tuple[str, int]]:
        return [(p.type_name, p.shape[0]) for p in self.parts]


class HalfMatrix(BlockWeight):
    """``[N, K]`` float16 rows as stored (``raw``: their bytes, ``[N, 2K]`` uint8), run
    by quant_linear.cpp's float16 kernel (F16C widening, float32 FMAs in one fixed order
    per output element, so a row's result does not depend on its batch) under type code
    ``F16_CODE``, which cpu_moe.cpp runs too: the experts of a float16 or bfloat16
    checkpoint (``half_matrix``). Nothing beside the halves: no float32 copy, no fbgemm
    packing."""

    def __init__(self, w: Tensor) -> None:
        super().__init__(
            w.contiguous().view(torch.uint8), "F16", (int(w.shape[0]), int(w.shape[1]))
        )

    def __post_init__(self) -> None:
        self.code = F16_CODE

    def half(self) -> Tensor:
        """The rows, ``[N, K]`` float16 (a view)."""
        return self.raw.view(torch.float16)

    def dequantize(self) -> Tensor:
        return self.half().float()

    def rows(self, ids: Tensor) -> Tensor:
        return self.half().index_select(0, ids).float()

    def select_rows(self, rows: Tensor) -> BlockWeight:
        return HalfMatrix(self.half().index_select(0, rows))

    def row_range(self, a: int, b: int) -> BlockWeight:
        return HalfMatrix(self.half()[a:b])

    def columns(self, a: int, b: int) -> BlockWeight | None:
        return HalfMatrix(self.half()[:, a:b])

    def owned(self) -> BlockWeight:
        return HalfMatrix(self.half().clone())


def half_matrix(w: Tensor) -> HalfMatrix | None:
    """``w [N, K]`` (float16, or float32 from a float16/bfloat16 checkpoint) as a
    ``HalfMatrix``, or None where the kernel cannot run it: no AVX2 kernels here, or a
    weight past float16's range (fbgemm would saturate it; such a checkpoint keeps that
    path). A float32 from bfloat16 rounds to float16 as fbgemm's packing rounds it (to
    nearest), so the weights are the ones fbgemm multiplied; every bfloat16 value in
    float16's normal range (6.1e-5 to 65504) is exact in float16, whose 11-bit
    significand holds bfloat16's 8."""
    if w.dim() != 2 or w.device.type != "cpu":
        return None
    from structllm.kernels import cpu_ext

    if cpu_ext.load_quant() is None:
        return None
    h = w.detach().to(torch.float16)
    if w.dtype != torch.float16 and bool((h.isinf() & ~w.isinf()).any()):
        return None
    return HalfMatrix(h)


class HalfWeight:
    """``[N, K]`` float16 weight prepacked for fbgemm (CPU); float32 in and out."""

    def __init__(self, w: Tensor) -> None:
        self.shape = (int(w.shape[0]), int(w.shape[1]))
        self.packed = torch.ops.quantized.linear_prepack_fp16(w.float().contiguous(), None)

    @property
    def nbytes(self) -> int:
        return 2 * self.shape[0] * self.shape[1]


class HalfRows(BlockWeight):
    """A float16 ``[N, K]`` table: an F16/BF16 file's token embedding, which may also be
    the (tied) LM head. Rows are looked up straight into float32; as a matmul weight it
    is packed for fbgemm's float16 kernel on first use. No float32 copy is ever made
    (a float32 table for the lookup beside the packed head held 3x the file's bytes)."""

    def __init__(self, w: Tensor) -> None:
        super().__init__(w.contiguous(), "F16", (int(w.shape[0]), int(w.shape[1])))
        self.half: HalfWeight | None = None  # the packed matmul weight, once used as one

    def matmul_weight(self) -> Weight:
        if self.half is None:
            if not half_linear_available():
                return self.raw.float()  # no fbgemm here: a float32 copy per call
            self.half = HalfWeight(self.raw)
        return self.half

    @property
    def nbytes(self) -> int:
        return self.raw.numel() * 2 + (self.half.nbytes if self.half is not None else 0)

    def dequantize(self) -> Tensor:
        return self.raw.float()

    def rows(self, ids: Tensor) -> Tensor:
        return self.raw.index_select(0, ids).float()

    def select_rows(self, rows: Tensor) -> BlockWeight:
        return HalfRows(self.raw.index_select(0, rows))

    def row_range(self, a: int, b: int) -> BlockWeight:
        return HalfRows(self.raw[a:b])

    def columns(self, a: int, b: int) -> BlockWeight | None:
        return HalfRows(self.raw[:, a:b])

    def owned(self) -> BlockWeight:
        return HalfRows(self.raw.clone())


@cache
def half_linear_available() -> bool:
    """Whether this torch build has fbgemm's float16 linear (x86 CPU builds do)."""
    try:
        w = HalfWeight(torch.ones(4, 4))
        y = torch.ops.quantized.linear_dynamic_fp16(torch.ones(2, 4), w.packed)
        return bool(torch.allclose(y, torch.full((2, 4), 4.0)))
    except (AttributeError, RuntimeError):
        return False


Weight = Tensor | HalfWeight | BlockWeight


def kernel_parts(w: object, int8_ok: bool) -> list[tuple[Tensor, int, bool]] | None:
    """A weight's row parts as the native loops take them (cpu_moe.cpp's experts,
    cpu_decode.cpp's layers): ``(raw [rows, bytes] uint8, type code, int8 allowed)`` per
    part of a ``BlockWeight`` or ``MixedWeight`` (int8 where ``int8_ok`` and the type
    has that path); None for anything else (``HalfRows``, fbgemm's ``HalfWeight``,
    float32) or a type without a kernel."""
    if isinstance(w, HalfRows) or not isinstance(w, BlockWeight):
        return None
    parts = w.parts if isinstance(w, MixedWeight) else [w]
    if any(p.code < 0 for p in parts):
        return None
    return [(p.raw.contiguous(), p.code, int8_ok and p.type_name in int8_types()) for p in parts]


def linear(
    x: Tensor,
    w: Weight,
    b: Tensor | None = None,
    int8_ok: bool = False,
) -> Tensor:
    """``x [..., K] @ w.T + b`` -> ``[..., N]``. ``int8_ok=True``: a ``BlockWeight`` of an
    ``int8_types()`` type may take the int8 path (see ``block_mode``); the caller vouches
    that 8-bit activations per block of 32 are precise enough for this matmul."""
    if isinstance(w, HalfRows):
        return linear(x, w.matmul_weight(), b)
    if isinstance(w, MixedWeight):  # each part in its own type, into its own columns
        y = torch.cat([linear(x, p, None, int8_ok) for p in w.parts], dim=-1)
        return y if b is None else y.add_(b)
    if isinstance(w, BlockWeight):
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        mode = block_mode(x2.shape[0], int8_ok and w.type_name in int8_types())
        if x2.dtype != torch.float32:
            x2 = x2.float()
        y = (_KERNELS or _kernels()).linear(x2, w.raw, w.code, mode)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], w.shape[0])
        return y if b is None else y.add_(b)
    if isinstance(w, HalfWeight):
        y = torch.ops.quantized.linear_dynamic_fp16(x.float(), w.packed)
        return y if b is None else y.add_(b)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def weight_bytes(w: Weight) -> int:
    """Bytes a weight holds (for reports and memory tests)."""
    if isinstance(w, BlockWeight | HalfWeight):
        return w.nbytes
    return w.numel() * w.element_size()
