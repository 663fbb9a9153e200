"""StableLM (``StableLmForCausalLM``: StableLM 2 1.6B/12B, StableLM 3B 4E1T, StableCode):
a classic layout (``model.classic``): LayerNorms with biases, Llama's gated MLP and
q/k/v projections (biases by ``use_qkv_bias``), partial rotary embeddings on the first
quarter of each head (Hugging Face's "halves" layout, permuted to ours), per-head q/k
LayerNorms with ``qk_layernorm`` (the 12B's: ``q_layernorm.norms.{h}``, one weight per
head, no bias) and, with ``use_parallel_residual``, attention and MLP side by side on
the input norm (the 12B again)."""

from __future__ import annotations

import torch
from torch import Tensor

from structllm.model.classic import ClassicModel, from_hf_norms
from structllm.model.config import ModelConfig
from structllm.model.llama import HFNames
from structllm.model.llama import hf_to_native as _hf_to_native


class StableLmNames(HFNames):
    input_layernorm = None  # (with their biases: classic.from_hf_norms)
    post_attention_layernorm = None


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    norms = {"input_layernorm": "model.layers.{i}.input_layernorm"}
    if cfg.parallel_block == "none":
        norms["post_attention_layernorm"] = "model.layers.{i}.post_attention_layernorm"
    from_hf_norms(state, out, cfg, norms)
    out["norm_bias"] = state.pop("model.norm.bias")
    if cfg.qk_norm == "layer_heads":  # one LayerNorm per head -> [H * D] weights
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}.self_attn."
            for qk, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads)):
                w = [state.pop(f"{p}{qk}_layernorm.norms.{h}.weight") for h in range(heads)]
                state[f"{p}{qk}_norm.weight"] = torch.cat(w)
    return {**out, **_hf_to_native(state, cfg, StableLmNames)}


MODEL = ClassicModel
