"""``--lora-dtype``'s ``auto`` rule (``model.formats.resolve_lora_dtype``): how adapters'
weights are stored for each weight format. Their arithmetic against ``PeftModel`` per
storage type is tests/engine/test_lora.py's."""

from __future__ import annotations

import pytest
import torch

from structllm.config import EngineConfig
from structllm.model.formats import WeightFormat, resolve_lora_dtype
from tests.support.models import EXACT

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("fmt", "want"),
    [
        (WeightFormat(torch.float32), torch.float32),  # the exact path stays within 1e-4
        (WeightFormat(torch.float32, blocks=True, half="file"), torch.float16),
        (WeightFormat(torch.float32, half="all"), torch.float16),
    ],
    ids=["exact", "gguf-blocks", "float16-weights"],
)
def test_auto_on_cpu_follows_the_weights(fmt: WeightFormat, want: torch.dtype) -> None:
    assert resolve_lora_dtype(EngineConfig(), CPU, fmt) == want


def test_auto_with_bfloat16_activations_is_bfloat16() -> None:
    config = EngineConfig(dtype="bfloat16")
    assert resolve_lora_dtype(config, CPU, WeightFormat(torch.bfloat16)) == torch.bfloat16


def test_auto_without_weights_follows_the_flags() -> None:
    """The null model has no weight format: the exact flags keep float32."""
    assert resolve_lora_dtype(EngineConfig(**EXACT), CPU, None) == torch.float32
    assert resolve_lora_dtype(EngineConfig(), CPU, None) == torch.float16


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_an_explicit_value_is_kept_on_every_format(name: str) -> None:
    want = getattr(torch, name)
    for fmt in (WeightFormat(torch.float32), WeightFormat(torch.float32, blocks=True)):
        assert resolve_lora_dtype(EngineConfig(lora_dtype=name), CPU, fmt) == want
    assert resolve_lora_dtype(EngineConfig(lora_dtype=name), torch.device("cuda"), None) == want


def test_auto_on_cuda_is_float32() -> None:
    assert resolve_lora_dtype(EngineConfig(), torch.device("cuda"), None) == torch.float32


def test_a_bad_value_is_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match="lora_dtype must be auto, float32, float16 or bfloat16"):
        EngineConfig(lora_dtype="int8")
