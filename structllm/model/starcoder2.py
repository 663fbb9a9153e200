"""StarCoder2 (``Starcoder2ForCausalLM``: StarCoder2 3B/7B/15B): a classic layout
(``model.classic``): LayerNorms with biases, attention then an ungated tanh-GELU MLP
(``c_fc``, ``c_proj``), biases on every projection (``use_bias``), grouped KV heads,
and a sliding window on every layer (its blocks behind the window given back, as
Mistral's)."""

from __future__ import annotations

from torch import Tensor

from structllm.model import classic
from structllm.model.classic import ClassicModel, ClassicNames
from structllm.model.config import ModelConfig


class Starcoder2Names(ClassicNames):
    up, down = "mlp.c_fc", "mlp.c_proj"


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return classic.hf_to_native(state, cfg, Starcoder2Names)


MODEL = ClassicModel
