"""NomicBERT (``NomicBertModel``: nomic-embed-text, as transformers saves it): the BERT
encoder of ``model.bert`` (post-LayerNorm layers, token types, attention both ways) with
rotary q/k in place of a position table, and bias-free projections with a SwiGLU MLP
(``silu(gate) * up``).

Checkpoints (nomic-ai's, and transformers' ``save_pretrained``) hold the original names:
``emb_ln``, ``encoder.layers.{i}.attn.Wqkv`` (q, k, v stacked), ``attn.out_proj``,
``mlp.fc11`` (up), ``mlp.fc12`` (gate), ``mlp.fc2``, ``norm1`` (after attention),
``norm2`` (after the MLP: ours ``input_layernorm``, see ``model.bert``); transformers'
loaded names (``self_attn.q_proj``, ...) are read too. q/k rows come in rotate-half
order, interleaved here as ours. nomic-ai's ``config.json`` (remote code: ``n_embd``,
``rotary_emb_base``, ``activation_function: swiglu``) reads as transformers' does."""

from __future__ import annotations

import torch
from torch import Tensor

from structllm.model.bert import BertModel, encoder_body
from structllm.model.config import ModelConfig
from structllm.model.layers import interleave_rope_rows

# the original (contrastors') names, which transformers saves too -> transformers' own
_ORIGINAL = (
    ("emb_ln.", "embeddings.LayerNorm."),
    ("encoder.layers.", "layers."),
    (".attn.out_proj.", ".self_attn.o_proj."),
    (".mlp.fc11.", ".mlp.up_proj."),
    (".mlp.fc12.", ".mlp.gate_proj."),
    (".mlp.fc2.", ".mlp.down_proj."),
    (".norm1.", ".post_attention_layernorm."),
    (".norm2.", ".post_mlp_layernorm."),
)


def _renamed(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` under transformers' names (``attn.Wqkv`` kept: q, k, v stacked)."""
    out: dict[str, Tensor] = {}
    for k, v in state.items():
        for old, new in _ORIGINAL:
            k = k.replace(old, new)
        out[k] = v
    return out


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    body, out = encoder_body(_renamed(state), cfg)
    nh = cfg.num_heads
    for i in range(cfg.num_layers):
        p = o = f"layers.{i}."
        if p + "attn.Wqkv.weight" in body:  # [3 * H * D, hidden]: q, k, v
            q, k, v = body.pop(p + "attn.Wqkv.weight").chunk(3)
        else:
            q, k, v = (body.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv")
        q, k = interleave_rope_rows(q, nh, cfg.rope_dim), interleave_rope_rows(k, nh, cfg.rope_dim)
        out[o + "qkv_proj"] = torch.cat([q, k, v])
        out[o + "o_proj"] = body.pop(p + "self_attn.o_proj.weight")
        gate, up = body.pop(p + "mlp.gate_proj.weight"), body.pop(p + "mlp.up_proj.weight")
        out[o + "gate_up_proj"] = torch.cat([gate, up])
        out[o + "down_proj"] = body.pop(p + "mlp.down_proj.weight")
        for ours, theirs in (
            ("post_attention_layernorm", "post_attention_layernorm"),
            ("input_layernorm", "post_mlp_layernorm"),
        ):
            out[o + ours] = body.pop(f"{p}{theirs}.weight")
            out[o + ours + "_bias"] = body.pop(f"{p}{theirs}.bias")
    return out


MODEL = BertModel
