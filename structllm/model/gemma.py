"""Gemma 2 and Gemma 3 (text): the Llama decoder with

- embeddings scaled by ``sqrt(hidden)``; ``(1 + w)`` RMSNorms (the loader stores
  ``1 + w``, as llama.cpp's converter does);
- norms before and after attention and the MLP (``pre_norms``, ``post_norms``);
- GeGLU with tanh GELU (``mlp_act == "gelu_tanh"``);
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


# a multimodal checkpoint's text model (Gemma3ForConditionalGeneration): saved under
# language_model.model. (and by transformers 4.52-4.57 under model.language_model.);
# the vision tower and projector are not loaded
_TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_IMAGE_PARTS = ("vision_tower.", "multi_modal_projector.")


def text_model_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` under a text model's names (see ``_TEXT_PREFIXES``), image parts out."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        old = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        if old is not None:
            out[_TEXT_PREFIXES[old] + name[len(old) :]] = t
        elif not name.removeprefix("model.").startswith(_IMAGE_PARTS):
            out[name] = t
    return out


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return _hf_to_native(text_model_names(state), cfg, GemmaNames)


MODEL = GemmaModel
