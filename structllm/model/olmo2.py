"""OLMo 2: the Llama decoder with its norms after attention and the MLP instead of
before (``pre_norms=False``, ``post_norms=True``) and q/k RMSNorms over the whole
projection (``qk_norm == "full"``; not with tensor parallelism, which would split
them)."""

from __future__ import annotations

from torch import Tensor

from structllm.model.config import ModelConfig
from structllm.model.llama import HFNames, LlamaModel
from structllm.model.llama import hf_to_native as _hf_to_native


class Olmo2Model(LlamaModel):
    """``LlamaModel`` run with OLMo 2's norm placement."""


class Olmo2Names(HFNames):
    input_layernorm = None
    post_attention_layernorm = None
    attn_out_norm = "post_attention_layernorm"
    mlp_out_norm = "post_feedforward_layernorm"


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return _hf_to_native(state, cfg, Olmo2Names)


MODEL = Olmo2Model
