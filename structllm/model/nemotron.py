"""Nemotron (``NemotronForCausalLM``: Nemotron-4, Minitron): a classic layout
(``model.classic``): LayerNorm1P, a LayerNorm with a bias whose weight is ``1 + w``
(the loader adds the 1, as llama.cpp's converter does), attention then an ungated
relu-squared MLP, partial rotary (Hugging Face's "halves" layout, permuted to ours),
biases where the config asks (``attention_bias``, ``mlp_bias``)."""

from __future__ import annotations

from torch import Tensor

from structllm.model import classic
from structllm.model.classic import ClassicModel, ClassicNames
from structllm.model.config import ModelConfig


class NemotronNames(ClassicNames):
    norm_plus_one = True


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return classic.hf_to_native(state, cfg, NemotronNames)


MODEL = ClassicModel
