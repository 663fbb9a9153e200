"""GPT-2 (``GPT2LMHeadModel``) and GPT-BigCode (``GPTBigCodeForCausalLM``: SantaCoder,
StarCoder 1, WizardCoder): a classic layout (``model.classic``) with learned absolute
positions added to the embedding (``wpe``) and no rotary embedding, LayerNorms with
biases, biases on every projection, an ungated GELU MLP, a head tied to the embedding.

GPT-2's matrices are ``Conv1D``s, stored ``[in, out]``: transposed here. Its q/k/v are
one matrix ``[q | k | v]`` (``c_attn``); BigCode's with ``multi_query`` too (one KV
head: ``[q (H*D) | k (D) | v (D)]``), without it grouped per head (``[H, 3, D]``,
regrouped as ours). The published GPT-2 checkpoints' names lack the ``transformer.``
prefix transformers saves them with."""

from __future__ import annotations

from torch import Tensor

from structllm.model import classic
from structllm.model.classic import ClassicModel, ClassicNames
from structllm.model.config import ModelConfig

# GPT-2's Conv1D matrices ([in, out]), by their name under a layer
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class GPT2Names(ClassicNames):
    embed = "transformer.wte"
    final_norm = "transformer.ln_f"
    layers = "transformer.h.{i}."
    qkv = "attn.c_attn"
    o = "attn.c_proj"
    up, down = "mlp.c_fc", "mlp.c_proj"
    input_layernorm = "ln_1"
    post_attention_layernorm = "ln_2"
    rope_interleaved = True  # (no rotary: the q/k rows as they are)


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    if "wte.weight" in state:  # a published GPT-2 checkpoint's names
        state = {"transformer." + k: v for k, v in state.items()}
    h, d = cfg.num_heads, cfg.head_dim
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        if cfg.architecture == "gpt2":
            for name in _CONV1D:
                state[p + name + ".weight"] = state[p + name + ".weight"].t().contiguous()
        elif cfg.num_kv_heads == h:  # BigCode without multi_query: [H, 3, D] rows
            for kind in ("weight", "bias"):
                w = state[f"{p}attn.c_attn.{kind}"]
                regrouped = w.view(h, 3, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
                state[f"{p}attn.c_attn.{kind}"] = regrouped
    out = classic.hf_to_native(state, cfg, GPT2Names)
    out["position_embeddings"] = state.pop("transformer.wpe.weight")
    return out


MODEL = ClassicModel
