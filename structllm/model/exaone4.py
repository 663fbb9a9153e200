"""EXAONE 4.0: OLMo 2's norm placement (RMSNorms on the attention and MLP outputs, none
before them), q/k RMSNorms per head, and in the 32B three sliding-window layers to one
global layer, where only the windowed layers rotate q and k (the global ones have no
position embedding: ``rope_layers``); a model without a window rotates in every layer.
"""

from __future__ import annotations

from torch import Tensor

from structllm.model.config import ModelConfig
from structllm.model.llama import HFNames, LlamaModel
from structllm.model.llama import hf_to_native as _hf_to_native


class Exaone4Model(LlamaModel):
    """``LlamaModel`` with EXAONE 4.0's options (``ModelConfig``)."""


class Exaone4Names(HFNames):
    input_layernorm = None
    post_attention_layernorm = None
    attn_out_norm = "post_attention_layernorm"
    mlp_out_norm = "post_feedforward_layernorm"


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return _hf_to_native(state, cfg, Exaone4Names)


MODEL = Exaone4Model
