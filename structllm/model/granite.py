"""Granite (3.x): the Llama decoder with an embedding multiplier, a residual
multiplier on each attention and MLP output, its own softmax scale
(``attention_multiplier``) and logits divided by ``logits_scaling``."""

from __future__ import annotations

from torch import Tensor

from structllm.model.config import ModelConfig
from structllm.model.llama import HFNames, LlamaModel
from structllm.model.llama import hf_to_native as _hf_to_native


class GraniteModel(LlamaModel):
    """``LlamaModel`` with Granite's multipliers (``ModelConfig``)."""


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return _hf_to_native(state, cfg, HFNames)


MODEL = GraniteModel
