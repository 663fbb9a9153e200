"""Falcon (``FalconForCausalLM``: Falcon 7B/40B/180B, Falcon 2 11B): a classic layout
(``model.classic``, ``config._falcon`` says which block): LayerNorms with biases, an
ungated GELU MLP, full rotary (Hugging Face's "halves" layout, permuted to ours).

Its q/k/v are one matrix (``query_key_value``) whose rows are regrouped here as ours
``[q heads | k heads | v heads]``: with ``new_decoder_architecture`` grouped per KV
head (``[Hkv, G + 2, D]``: the group's G query heads, then its key and value), with
``multi_query`` already ours (``[H + 2, D]``), else per head (``[H, 3, D]``). Its
names are under ``transformer.``; the new architecture's two norms are ``ln_attn``
and ``ln_mlp``."""

from __future__ import annotations

import torch
from torch import Tensor

from structllm.model import classic
from structllm.model.classic import ClassicModel, ClassicNames
from structllm.model.config import ModelConfig


class FalconNames(ClassicNames):
    embed = "transformer.word_embeddings"
    final_norm = "transformer.ln_f"
    layers = "transformer.h.{i}."
    qkv = "self_attention.query_key_value"
    o = "self_attention.dense"
    up, down = "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"


class FalconNewNames(FalconNames):  # new_decoder_architecture with two norms
    input_layernorm = "ln_attn"
    post_attention_layernorm = "ln_mlp"


def _regroup(w: Tensor, cfg: ModelConfig) -> Tensor:
    """``query_key_value``'s rows (or bias) in our order (see the module docstring)."""
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if kv == 1 and h > 1:  # multi_query: [q | k | v] already
        return w
    rest = w.shape[1:]
    groups = w.view(kv, h // kv + 2, d, *rest)  # [Hkv, G + 2, D, ...]
    q = groups[:, :-2].reshape(h * d, *rest)
    k, v = groups[:, -2].reshape(kv * d, *rest), groups[:, -1].reshape(kv * d, *rest)
    return torch.cat([q, k, v])


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    for i in range(cfg.num_layers):
        for kind in ("weight", "bias"):
            name = f"transformer.h.{i}.self_attention.query_key_value.{kind}"
            if name in state:
                state[name] = _regroup(state[name], cfg)
    names = FalconNewNames if cfg.parallel_block == "separate" else FalconNames
    return classic.hf_to_native(state, cfg, names)


MODEL = ClassicModel
