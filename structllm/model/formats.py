"""The format the weights run in, from ``--dtype`` and ``--quantization`` (vLLM's names).

On CPU, activations and norms are float32 (bfloat16 only if asked for; the KV cache's
dtype is ``resolve_kv_cache_dtype``'s); what varies is how the matmul weights are held:

- ``--quantization gguf`` (``auto`` picks it for a GGUF file on CPU): Q4_0/Q4_1/Q5_0/
  Q5_1/Q8_0 and Q4_K/Q5_K/Q6_K matrices (and the embedding table, which is also the
  tied LM head) stay as the file's blocks (the k-quants as their super-blocks) and run
  through the C++ block kernels, each matrix in its own type; other matrices are
  dequantised (and named at start-up), F16/BF16 ones run as float16 unless ``--dtype
  float32`` (``--dtype float16``: all of them).
- ``--quantization none``: weights dequantised to ``--dtype``. On CPU ``float32`` packs
  them for oneDNN (today's exact path); ``float16`` packs them for fbgemm's float16
  matmul (float32 activations, half the bytes read), which ``auto`` picks for float
  checkpoints (Hugging Face directories) because it was measured faster at decode sizes.

On CUDA, ``--dtype`` is the model's dtype as before and GGUF blocks are refused.
Tensor parallelism shards GGUF blocks as blocks (``model/sharding.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from structllm.config import EngineConfig
from structllm.model.files import ModelFiles

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class WeightFormat:
    """``dtype``: activations, norms and plain weights. ``blocks``: keep GGUF
    block matrices. ``half``: which float matmul weights run as fbgemm float16:
    ``"none"``, ``"all"``, or ``"file"`` (those stored as F16/BF16 in a GGUF file)."""

    dtype: torch.dtype
    blocks: bool = False
    half: str = "none"

    @property
    def exact(self) -> bool:
        """Plain float32 weights on CPU: the path that matches transformers token for
        token, so it runs torch's own element-wise ops too."""
        return self == WeightFormat(torch.float32)

    def describe(self) -> str:
        if self.blocks:
            return (
                f"GGUF blocks (other matrices: {'float16' if self.half == 'all' else 'as stored'})"
            )
        return (
            "float16 matmul weights"
            if self.half == "all"
            else str(self.dtype).removeprefix("torch.")
        )


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The activation dtype (the KV cache's: ``resolve_kv_cache_dtype``)."""
    if device.type == "cpu":
        # float16 on CPU means float16 *weights* (fbgemm); activations stay float32
        return torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def resolve_format(
    config: EngineConfig, device: torch.device, files: ModelFiles, world_size: int = 1
) -> WeightFormat:
    """The format for ``files`` on ``device``; ``ValueError`` for a bad combination."""
    dtype = resolve_dtype(config, device)
    q, is_gguf, cpu = config.quantization, files.source is not None, device.type == "cpu"
    if q == "gguf":
        if not is_gguf:
            raise ValueError(
                f"--quantization gguf needs a GGUF file, but {files.name} is a Hugging Face "
                "checkpoint; use --quantization none or auto"
            )
        if not cpu:
            raise ValueError(
                "--quantization gguf runs on CPU only (C++ block kernels); "
                "on CUDA use --quantization none, which dequantises the file to --dtype"
            )
        if dtype != torch.float32:
            raise ValueError(
                "--quantization gguf computes in float32 on CPU; "
                "use --dtype auto, float32 or float16"
            )
    blocks = q == "gguf" or (q == "auto" and is_gguf and cpu and dtype == torch.float32)
    if blocks and not _block_kernels_available():
        if q == "gguf":
            raise ValueError(
                "--quantization gguf needs the C++ block kernels "
                "(an AVX2/FMA/F16C CPU and a compiler)"
            )
        blocks = False
    if not cpu or dtype != torch.float32:
        return WeightFormat(dtype)
    if blocks:
        half = {"float16": "all", "float32": "none"}.get(config.dtype, "file")
        return WeightFormat(dtype, blocks=True, half=_checked_half(half))
    if config.dtype == "float16" or (config.dtype == "auto" and not is_gguf and _half_available()):
        return WeightFormat(dtype, half=_checked_half("all"))
    return WeightFormat(dtype)


def _checked_half(half: str) -> str:
    if half == "all" and not _half_available():
        raise ValueError(
            "--dtype float16 on CPU needs fbgemm's float16 matmul (an x86 torch build)"
        )
    return half


def _block_kernels_available() -> bool:
    from structllm.kernels import cpu_ext

    return cpu_ext.load_quant() is not None


def _half_available() -> bool:
    from structllm.kernels.packed import half_linear_available

    return half_linear_available()


_KV_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def resolve_kv_cache_dtype(
    config: EngineConfig, device: torch.device, fmt: WeightFormat | None
) -> torch.dtype:
    """The paged KV cache's dtype from ``--kv-cache-dtype`` (``fmt``: the weights' format,
    None for the null model, which has none); ``ValueError`` for a bad combination.

    ``auto`` on CPU with float32 activations: float32 when the weights run in the exact
    float32 format (no GGUF blocks, no float16 matmul weights), so that path keeps its
    token-for-token equality with transformers; float16 otherwise, which halves what
    decode attention reads per step (and the bytes per block) at a rounding far below
    the weights' own (measured: see tests/engine/test_kv_cache_dtype.py). With bfloat16
    activations (CPU or CUDA) or float16 ones (CUDA) ``auto`` is the model's dtype.
    """
    dtype = resolve_dtype(config, device)
    if config.kv_cache_dtype != "auto":
        kv = _KV_DTYPES[config.kv_cache_dtype]
        if device.type == "cuda" and kv.itemsize > dtype.itemsize:
            raise ValueError(
                f"--kv-cache-dtype {config.kv_cache_dtype} on CUDA needs --dtype float32: "
                "the Triton kernels compute attention in the model's dtype "
                f"({str(dtype).removeprefix('torch.')}), so a wider "
                "cache would only cost memory"
            )
        return kv
    if device.type != "cpu" or dtype != torch.float32:
        return dtype
    exact = (
        fmt == WeightFormat(torch.float32)
        if fmt is not None
        else (config.dtype == "float32" and config.quantization == "none")
    )
    return torch.float32 if exact else torch.float16


_LORA_DTYPES = {**_KV_DTYPES, "bfloat16": torch.bfloat16}


def resolve_lora_dtype(
    config: EngineConfig, device: torch.device, fmt: WeightFormat | None
) -> torch.dtype:
    """How LoRA adapters' weights are stored, from ``--lora-dtype`` (they are computed in
    float32 on CPU whatever the storage).

    ``auto``, vLLM's "the model's dtype": on CPU float32 when the weights run in the
    exact float32 format (so that path stays within 1e-4 of ``PeftModel``), float16
    otherwise, where the base's own matmul weights are float16 or 4-8-bit blocks and an
    adapter's float16 rounding (2^-11 of its delta) is far below theirs, while its bytes
    halve: 16 distinct rank-16 adapters of the default model are 4x the Q4_1 base's
    bytes in float32, which a step of distinct adapters streams. With bfloat16
    activations (``--dtype bfloat16`` on CPU) bfloat16. On CUDA float32, as before this
    rule (the slots' Triton kernels are tested so).
    """
    if config.lora_dtype != "auto":
        return _LORA_DTYPES[config.lora_dtype]
    if device.type != "cpu":
        return torch.float32
    if (activations := resolve_dtype(config, device)) != torch.float32:
        return activations
    exact = (
        fmt == WeightFormat(torch.float32)
        if fmt is not None
        else (config.dtype == "float32" and config.quantization == "none")
    )
    return torch.float32 if exact else torch.float16
