"""An mmproj GGUF file's tensors by llama.cpp's names, read as the engine's weight format
holds the text model's matrices (``model.formats``): with GGUF blocks on CPU a block
type (e.g. Q8_0) stays blocks and F16 runs as fbgemm float16, both through
``packed.linear``; on the exact path (``--dtype float32 --quantization none``) and on
CUDA everything is dequantised to the model's dtype. Shapes are numpy's (ggml's ``ne``
reversed, which is transformers' layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from structllm.kernels.packed import (
    BLOCK,
    BLOCK_TYPES,
    BlockWeight,
    HalfWeight,
    Weight,
    half_linear_available,
)
from structllm.model.formats import WeightFormat
from structllm.model.gguf import dequantize, open_gguf


class MmprojTensors:
    """An mmproj file's tensors by name, read as ``fmt`` holds matrices on ``device``."""

    def __init__(self, path: Path, fmt: WeightFormat, device: torch.device) -> None:
        self.path = path
        self.tensors = {t.name: t for t in open_gguf(path).tensors}
        cpu = device.type == "cpu"
        self.dtype = torch.float32 if cpu else fmt.dtype
        self.blocks = cpu and fmt.blocks
        self.half = cpu and fmt.half != "none" and half_linear_available()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _get(self, name: str) -> Any:
        t = self.tensors.get(name)
        if t is None:
            raise ValueError(f"--mmproj {self.path.name} has no tensor {name!r}")
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(x) for x in reversed(self._get(name).shape))

    def kind(self, name: str) -> str:
        return str(self._get(name).tensor_type.name)

    def float(self, name: str) -> Tensor:
        """Dequantised, in the model's dtype."""
        t = self._get(name)
        return dequantize(t.data, t.tensor_type.name, self.shape(name)).to(self.dtype)

    def matrix(self, names: list[str], rows: Tensor | None = None) -> Weight:
        """``names``' ``[N_i, K]`` matrices stacked by rows as one matmul weight: GGUF
        blocks (each part in its own type) or fbgemm float16 where the format keeps them,
        else a float tensor. ``rows``: each part's rows taken in that order first (a
        block row is a whole row of blocks, so this is exact for every type)."""
        kinds = {self.kind(n) for n in names}
        k = self.shape(names[0])[-1]

        def ordered(w: Tensor) -> Tensor:
            return w if rows is None else w[rows]

        if self.blocks and kinds <= set(BLOCK_TYPES) and k % BLOCK == 0:
            parts = [BlockWeight.from_raw(self._get(n).data, self.kind(n), k) for n in names]
            if rows is not None:
                parts = [b.select_rows(rows) for b in parts]
            return BlockWeight.cat(parts)
        if self.half and kinds <= {"F16", "BF16"}:
            # float16 as stored; fbgemm packs its own copy (the float32 is transient)
            return HalfWeight(torch.cat([ordered(self.float(n)).half() for n in names]))
        return torch.cat([ordered(self.float(n)) for n in names])


def set_weight(module: nn.Module, name: str, w: Weight | None) -> None:
    """Parameter ``name`` of ``module`` replaced by ``w``: a parameter when a tensor,
    else a plain attribute (a packed weight, or None)."""
    if isinstance(w, Tensor):
        setattr(module, name, nn.Parameter(w.contiguous(), requires_grad=False))
    else:
        del module._parameters[name]
        setattr(module, name, w)
