"""Phi-3 and Phi-4-mini: the Llama decoder whose checkpoint fuses q/k/v (``qkv_proj``)
and gate/up (``gate_up_proj``) as we do, with LongRoPE scaling and partial rotary
embeddings where the config says so (``layers.rope_rows``)."""

from __future__ import annotations

from torch import Tensor

from structllm.model.config import ModelConfig
from structllm.model.llama import HFNames, LlamaModel
from structllm.model.llama import hf_to_native as _hf_to_native


class Phi3Model(LlamaModel):
    """``LlamaModel``; LongRoPE and partial rotary live in its rope table."""


class Phi3Names(HFNames):
    qkv = "self_attn.qkv_proj"
    gate_up = "mlp.gate_up_proj"


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return _hf_to_native(state, cfg, Phi3Names)


MODEL = Phi3Model
