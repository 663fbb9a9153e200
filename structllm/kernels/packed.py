"""Packed matmul weights and the ``linear`` that runs them: ``y = x @ W^T (+ b)``.

A weight ``W [N, K]`` is one of:
- a plain tensor (any dtype, any device): ``F.linear``;
- a oneDNN-packed float32 tensor (``is_mkldnn``, see ``LlamaModel.pack_weights``);
- ``HalfWeight``: float16 packed for fbgemm's ``linear_dynamic_fp16`` (CPU): half the
  bytes of float32, float32 activations and accumulation;
- ``BlockWeight``: GGUF blocks (Q4_0, Q4_1, Q8_0) as laid in the file, run by the C++
  kernels of ``quant_linear.cpp`` (CPU, AVX2 or AVX-512).

Activations are float32 for the last two. ``BlockWeight`` picks the kernel path by the
number of rows ``M`` of ``x`` (see ``block_mode``): the float path (weights dequantised
in registers, bit-exact to the float32 dequantisation, float32 math), from
``INT16_MIN_M`` rows on the int16 path (activations rounded to 16 bits per block of 32,
integer dot products of pairs), and the int8 path (8 bits per block: faster, less exact)
for the matmuls whose caller allows it (the MLP's) where the weights are 4-bit
(``INT8_TYPES``; from ``INT8_MIN_M`` rows; on by default, ``STRUCTLLM_QUANT_INT8_MIN_M=0``
keeps 16 bits).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK_TYPES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # the kernel's type codes
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # per 32 weights
BLOCK = 32

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
    """``INT16_MIN_M`` if set, else 1: the int16 path at every size. Decode sizes (1-4
    rows) run its row kernel, which reads each weight block once for all rows and folds
    8 blocks' scales at a time; at one row it ran the default model's Q4_1 matmuls
    1.4-1.6x faster than the float path on a 2-vCPU AVX-512 EPYC (weights cold in
    cache, bench/quant_linear.py --rows 1 --cold), where the float path, though it
    dequantises a 4-bit block through a 16-entry table, converts each block's scales
    one by one. ``STRUCTLLM_QUANT_INT16_MIN_M=0`` keeps the float path (float32
    activations, weights exactly the float32 dequantisation) at every size."""
    if INT16_MIN_M is not None:
        return INT16_MIN_M
    return 1


# Rows of x from which the int8 path runs (0: never), for the matmuls whose caller says
# they tolerate it (``linear(..., int8_ok=True)``: the MLP's gate/up and down) and whose
# weights are 4-bit. Activations rounded to 8 bits per block of 32, as llama.cpp does
# for every quantised matmul. For Q4 weights from 5 rows a blocked GEMM of u8 x s8
# products (vpmaddubsw, or VNNI's vpdpbusd), 1.3-1.6x the int16 GEMM's speed at 5-160
# rows on the AVX2 build (two threads; 1.35-1.6x one thread with AVX-512 VNNI); at 1-4
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
# Q8_0 weights stay on the int16 path (MLP in int8: 98.6%, under Q8_0's 99% bar), and so
# does the LM head (see ``LlamaModel.compute_logits``).
INT8_MIN_M = int(os.environ.get("STRUCTLLM_QUANT_INT8_MIN_M", "1"))
INT8_TYPES = frozenset({"Q4_0", "Q4_1"})


ROW_KERNEL_ROWS = 4  # quant_linear.cpp's MT_Q: up to this many rows read each block once


def block_mode(rows: int, int8_ok: bool = False) -> int:
    """The kernel path for ``rows`` rows of activations (``int8_ok``: the caller allows
    the int8 path, and the weights are of an ``INT8_TYPES`` type)."""
    if int8_ok and 0 < INT8_MIN_M <= rows:
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


@dataclass
class BlockWeight:
    """``[N, K]`` weight as GGUF blocks: ``raw [N, K/32 * block_bytes]`` uint8 (rows are
    independent, so row slices and concatenations stay valid)."""

    raw: Tensor
    type_name: str
    shape: tuple[int, int]
    code: int = field(init=False)  # the kernel's type code (BLOCK_TYPES)

    def __post_init__(self) -> None:
        self.code = BLOCK_TYPES[self.type_name]

    @classmethod
    def from_raw(cls, raw: Tensor, type_name: str, k: int) -> BlockWeight:
        if type_name not in BLOCK_TYPES or k % BLOCK:
            raise ValueError(f"not a supported block weight: {type_name} with {k} columns")
        raw = raw.reshape(-1, k // BLOCK * BLOCK_BYTES[type_name]).contiguous()
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

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight:
        """Row concatenation (all parts of one type and width)."""
        t, k = parts[0].type_name, parts[0].shape[1]
        assert all(p.type_name == t and p.shape[1] == k for p in parts)
        raw = torch.cat([p.raw for p in parts])
        return BlockWeight(raw, t, (raw.shape[0], k))


class HalfWeight:
    """``[N, K]`` float16 weight prepacked for fbgemm (CPU); float32 in and out."""

    def __init__(self, w: Tensor) -> None:
        self.shape = (int(w.shape[0]), int(w.shape[1]))
        self.packed = torch.ops.quantized.linear_prepack_fp16(w.float().contiguous(), None)

    @property
    def nbytes(self) -> int:
        return 2 * self.shape[0] * self.shape[1]


def half_linear_available() -> bool:
    """Whether this torch build has fbgemm's float16 linear (x86 CPU builds do)."""
    try:
        w = HalfWeight(torch.ones(4, 4))
        y = torch.ops.quantized.linear_dynamic_fp16(torch.ones(2, 4), w.packed)
        return bool(torch.allclose(y, torch.full((2, 4), 4.0)))
    except (AttributeError, RuntimeError):
        return False


Weight = Tensor | HalfWeight | BlockWeight


def linear(x: Tensor, w: Weight, b: Tensor | None = None, int8_ok: bool = False) -> Tensor:
    """``x [..., K] @ w.T + b`` -> ``[..., N]``. ``int8_ok=True``: a 4-bit ``BlockWeight``
    may take the int8 path (see ``INT8_MIN_M``); the caller vouches that 8-bit
    activations per block of 32 are precise enough for this matmul."""
    if isinstance(w, BlockWeight):
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        mode = block_mode(x2.shape[0], int8_ok and w.type_name in INT8_TYPES)
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
