"""Choosing the attention implementation for a device, dtype and shape."""

from __future__ import annotations

import torch

from structllm.kernels.attention import AttentionImpl, CpuAttention, TorchAttention


def get_attention_impl(
    name: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    shape: tuple[int, int, int, int] | None = None,
) -> AttentionImpl:
    """``"auto"``: Triton on CUDA; on CPU the C++ decode kernel for float32 when it builds
    and supports ``shape`` (block size, query heads, KV heads, head size), else the torch
    reference."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        elif dtype == torch.float32 and (shape is None or CpuAttention.supports(*shape)):
            from structllm.kernels import cpu_ext

            name = "cpu" if cpu_ext.load() is not None else "torch"
        else:
            name = "torch"
    if name == "torch":
        return TorchAttention()
    if name == "cpu":
        from structllm.kernels import cpu_ext

        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError("attention backend 'cpu' needs float32 on the CPU")
        if shape is not None and not CpuAttention.supports(*shape):
            raise ValueError(
                "attention backend 'cpu' does not support "
                f"(block size, heads, KV heads, head size) {shape}"
            )
        module = cpu_ext.load()
        if module is None:
            raise ValueError(
                "attention backend 'cpu' is not available: "
                "the C++ kernel did not build (see the log)"
            )
        return CpuAttention(module)
    if name == "triton":
        try:
            from structllm.kernels.triton_attention import TritonAttention, check_device
        except ImportError as e:
            raise ValueError(f"attention backend 'triton' is not available: {e}") from e
        check_device(device)
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; expected auto, torch, cpu or triton")
