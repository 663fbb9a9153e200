"""Command R (``CohereForCausalLM``: Command R, R+, Aya 23/Expanse) and Command R7B
(``Cohere2ForCausalLM``): a classic layout (``model.classic``): one LayerNorm without
a bias feeding attention and a gated SiLU MLP side by side, logits times
``logit_scale``, a head tied to the embedding. Its rotation pairs ``x[2i]`` with
``x[2i + 1]`` (GPT-J's layout, ours), so neither the checkpoint's q/k rows nor
llama.cpp's are permuted. Command R+'s q/k LayerNorms hold one weight per head
(``[H, D]``). Command R7B's global layers have no rotary embedding (``rope_layers``)."""

from __future__ import annotations

from torch import Tensor

from structllm.model import classic
from structllm.model.classic import ClassicModel, ClassicNames
from structllm.model.config import ModelConfig


class CohereNames(ClassicNames):
    post_attention_layernorm = None
    rope_interleaved = True


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return classic.hf_to_native(state, cfg, CohereNames)


MODEL = ClassicModel
