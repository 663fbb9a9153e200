"""Gemma, Gemma 2 and Gemma 3 (text): the Llama decoder with

- embeddings scaled by ``sqrt(hidden)``; ``(1 + w)`` RMSNorms (the loader stores
  ``1 + w``, as llama.cpp's converter does);
- GeGLU with tanh GELU (``mlp_act == "gelu_tanh"``).

Gemma (1) is only that (Llama's norm placement, softmax scale ``head_dim ** -0.5``).
Gemma 2 and 3 add

- norms before and after attention and the MLP (``pre_norms``, ``post_norms``);
- softmax scale ``query_pre_attn_scalar ** -0.5``;
- sliding-window and global layers (``layer_windows``: Gemma 2 alternates, Gemma 3 has
  five local layers to one global), attended within the window by every backend;
- Gemma 2: attention-logit and final-logit soft-capping;
- Gemma 3: q/k norms per head, and a rope base of its own for the local layers
  (``rope_local_theta``; the global layers' may be scaled).
"""

from __future__ import annotations

from torch import Tensor

from structllm.model.config import ModelConfig
from structllm.model.llama import HFNames, LlamaModel
from structllm.model.llama import hf_to_native as _hf_to_native


class GemmaModel(LlamaModel):
    """``LlamaModel`` run with Gemma's options (all in ``ModelConfig``)."""


class GemmaNames(HFNames):
    # Gemma's post_attention_layernorm normalises the attention output; the MLP's
    # input norm is pre_feedforward_layernorm (our post_attention_layernorm)
    post_attention_layernorm = "pre_feedforward_layernorm"
    attn_out_norm = "post_attention_layernorm"
    mlp_out_norm = "post_feedforward_layernorm"
    norm_plus_one = True


class Gemma1Names(HFNames):
    norm_plus_one = True  # Llama's names otherwise


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return _hf_to_native(state, cfg, Gemma1Names if cfg.architecture == "gemma" else GemmaNames)


MODEL = GemmaModel
