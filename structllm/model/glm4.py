"""GLM-4 (0414): the Llama decoder with q/k/v biases, RMSNorms on the attention and
MLP outputs besides the pre-norms (``post_norms``), partial rotary embeddings (the
first half of each head) and a fused gate/up projection, as ours ([gate | up]).

Its rotation pairs ``x[2i]`` with ``x[2i + 1]`` (GPT-J's layout, ours), so neither
the checkpoint's q/k rows nor llama.cpp's (which keeps them) are permuted.
"""

from __future__ import annotations

from torch import Tensor

from structllm.model.config import ModelConfig
from structllm.model.llama import HFNames, LlamaModel
from structllm.model.llama import hf_to_native as _hf_to_native


class Glm4Model(LlamaModel):
    """``LlamaModel`` with GLM-4's output norms (``ModelConfig.post_norms``)."""


class Glm4Names(HFNames):
    gate_up = "mlp.gate_up_proj"
    attn_out_norm = "post_self_attn_layernorm"
    mlp_out_norm = "post_mlp_layernorm"
    rope_interleaved = True


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return _hf_to_native(state, cfg, Glm4Names)


MODEL = Glm4Model
