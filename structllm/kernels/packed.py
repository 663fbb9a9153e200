"""Packed matmul weights and the ``linear`` that runs them: ``y = x @ W^T (+ b)``.

A weight ``W [N, K]`` is one of:
- a plain tensor (any dtype, any device): ``F.linear``;
- a oneDNN-packed float32 tensor (``is_mkldnn``, see ``LlamaModel.pack_weights``);
- ``HalfWeight``: float16 packed for fbgemm's ``linear_dynamic_fp16`` (CPU): half the
  bytes of float32, float32 activations and accumulation;
- ``BlockWeight``: GGUF blocks (Q4_0, Q4_1, Q8_0) as laid in the file, run by the C++
  kernels of ``quant_linear.cpp`` (CPU, AVX2 or AVX-512).

Activations are float32 for the last two. ``BlockWeight`` picks the kernel path by the
number of rows ``M`` of ``x``: the float path (weights dequantised in registers,
bit-exact to the float32 dequantisation), or from ``INT8_MIN_M`` rows on, if set, the
int8 path (activations quantised per block of 32, integer dot products).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK_TYPES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # the kernel's type codes
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # per 32 weights
BLOCK = 32

# Rows of x from which the int8 path runs (0: never). Measured on a 2-vCPU AVX-512 EPYC
# (shared, noisy; bench/offline_throughput.py and tests/engine/test_quant_model.py): the int8
# path was within noise of the float path up to 16 rows and only 10-20% faster at
# 32-256, while rounding activations to int8 cost SmolLM2-135M 1-3% top-1 agreement
# (Q8_0: 96.9% against the same weights in float32, below the 99% bar). So by default
# every size runs the float path; STRUCTLLM_QUANT_INT8_MIN_M=64 (say) turns it on.
INT8_MIN_M = int(os.environ.get("STRUCTLLM_QUANT_INT8_MIN_M", "0"))


def _kernels() -> Any:
    from structllm.kernels import cpu_ext

    module = cpu_ext.load_quant()
    if module is None:
        raise RuntimeError("the GGUF block kernels are unavailable on this machine (see the log)")
    return module


@dataclass
class BlockWeight:
    """``[N, K]`` weight as GGUF blocks: ``raw [N, K/32 * block_bytes]`` uint8 (rows are
    independent, so row slices and concatenations stay valid)."""

    raw: Tensor
    type_name: str
    shape: tuple[int, int]

    @classmethod
    def from_raw(cls, raw: Tensor, type_name: str, k: int) -> BlockWeight:
        if type_name not in BLOCK_TYPES or k % BLOCK:
            raise ValueError(f"not a supported block weight: {type_name} with {k} columns")
        raw = raw.reshape(-1, k // BLOCK * BLOCK_BYTES[type_name]).contiguous()
        return cls(raw, type_name, (raw.shape[0], k))

    @property
    def code(self) -> int:
        return BLOCK_TYPES[self.type_name]

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
        return BlockWeight(self.raw.index_select(0, rows).contiguous(), self.type_name, (len(rows), self.shape[1]))

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


def linear(x: Tensor, w: Weight, b: Tensor | None = None, float_path: bool = False) -> Tensor:
    """``x [..., K] @ w.T + b`` -> ``[..., N]``. ``float_path``: a ``BlockWeight`` runs
    the float path whatever the rows (the LM head: see ``LlamaModel.compute_logits``)."""
    if isinstance(w, BlockWeight):
        x2 = x.reshape(-1, x.shape[-1]).float()
        int8 = 0 < INT8_MIN_M <= x2.shape[0] and not float_path
        y = _kernels().linear(x2, w.raw, w.code, int8).view(*x.shape[:-1], w.shape[0])
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
