"""Phi-2 (``PhiForCausalLM``: Phi-1, Phi-1.5, Phi-2): a classic layout
(``model.classic``): one LayerNorm with a bias feeding attention and MLP side by side,
biases on q/k/v, the output projection (``dense``), the ungated GELU MLP (``fc1``,
``fc2``) and the LM head, partial rotary (Hugging Face's "halves" layout, permuted to
ours)."""

from __future__ import annotations

from torch import Tensor

from structllm.model import classic
from structllm.model.classic import ClassicModel, ClassicNames
from structllm.model.config import ModelConfig


class PhiNames(ClassicNames):
    final_norm = "model.final_layernorm"
    o = "self_attn.dense"
    up, down = "mlp.fc1", "mlp.fc2"
    post_attention_layernorm = None


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return classic.hf_to_native(state, cfg, PhiNames)


MODEL = ClassicModel
