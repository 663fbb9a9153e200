"""SmolLM3: the Llama decoder in which every fourth layer has no rotary embedding
(``rope_layers``, from the config's ``no_rope_layers``)."""

from __future__ import annotations

from torch import Tensor

from structllm.model.config import ModelConfig
from structllm.model.llama import HFNames, LlamaModel
from structllm.model.llama import hf_to_native as _hf_to_native


class SmolLM3Model(LlamaModel):
    """``LlamaModel`` whose no-rope layers skip the rotation (NoPE)."""


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return _hf_to_native(state, cfg, HFNames)


MODEL = SmolLM3Model
