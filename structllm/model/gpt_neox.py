"""GPT-NeoX (``GPTNeoXForCausalLM``: Pythia, GPT-NeoX-20B, StableLM-Alpha, RedPajama-INCITE,
Dolly v2): a classic layout (``model.classic``): LayerNorms with biases, attention and
MLP side by side each on its own norm (``use_parallel_residual``), an ungated GELU MLP
(``dense_h_to_4h``, ``dense_4h_to_h``) with biases, partial rotary (Hugging Face's
"halves" layout, permuted to ours).

Its q/k/v are one matrix whose rows are grouped per head (``[H, 3, D]``: each head's
q, k and v rows together), regrouped here as ours ``[q heads | k heads | v heads]``
(llama.cpp's converter regroups them so too). Hugging Face's names are under
``gpt_neox.``; the LM head is ``embed_out``."""

from __future__ import annotations

from torch import Tensor

from structllm.model import classic
from structllm.model.classic import ClassicModel, ClassicNames
from structllm.model.config import ModelConfig


class GPTNeoXNames(ClassicNames):
    embed = "gpt_neox.embed_in"
    final_norm = "gpt_neox.final_layer_norm"
    lm_head = "embed_out"
    layers = "gpt_neox.layers.{i}."
    qkv = "attention.query_key_value"
    o = "attention.dense"
    up, down = "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    if "lm_head.weight" in state:  # (transformers' in-memory name)
        state["embed_out.weight"] = state.pop("lm_head.weight")
    h, d = cfg.num_heads, cfg.head_dim
    for i in range(cfg.num_layers):
        for kind in ("weight", "bias"):
            name = f"gpt_neox.layers.{i}.attention.query_key_value.{kind}"
            if name in state:  # [H, 3, D, ...] -> [3, H, D, ...]
                w = state[name]
                state[name] = w.view(h, 3, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
    return classic.hf_to_native(state, cfg, GPTNeoXNames)


MODEL = ClassicModel
