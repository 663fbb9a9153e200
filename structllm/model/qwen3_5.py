"""Qwen3.5: a hybrid of Gated DeltaNet layers (``model.deltanet``; three in four) and
gated attention (``ModelConfig.attn_output_gate``: the attention output times
``sigmoid`` of a gate projection, before ``o_proj``) with q/k norms per head and a
partial rotary embedding. Its RMSNorms are ``(1 + w)`` (added at load), except the
DeltaNet's gated norm, whose weight is plain.

Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``) is the same model with every MLP a mixture of
experts (``layers.SparseMoe``: top k renormalised, plus a shared expert behind a sigmoid
gate).

The checkpoint's ``q_proj`` holds each head's query rows and then its gate rows
(``[H, 2, D, hidden]``); they are split here into ``qkv_proj``'s q and ``attn_gate``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from structllm.model import deltanet
from structllm.model.config import ModelConfig
from structllm.model.hybrid import HybridModel
from structllm.model.llama import HFNames, text_model_names
from structllm.model.llama import hf_to_native as _hf_to_native


class Qwen3_5Model(HybridModel):
    def mixer(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> nn.Module:
        return deltanet.GatedDeltaNet(
            cfg.hidden_size,
            cfg.linear_key_heads,
            cfg.linear_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
            cfg.conv_kernel,
            cfg.rms_norm_eps,
            dtype,
            cfg.linear_tiled_values,
        )


class Qwen3_5Names(HFNames):
    norm_plus_one = True


def experts_to_native(state: dict[str, Tensor], cfg: ModelConfig, i: int) -> dict[str, Tensor]:
    """Layer ``i``'s router, experts (one tensor per expert and matrix, or transformers'
    fused ``experts.gate_up_proj [E, 2F, hidden]`` / ``down_proj [E, hidden, F]``) and
    shared expert with its gate, taken out of ``state``."""
    p, o = f"model.layers.{i}.mlp.", f"layers.{i}.moe."
    out = {o + "router": state.pop(p + "gate.weight")}
    fused = p + "experts.gate_up_proj"
    for e in range(cfg.num_experts):
        x, y = f"{p}experts.{e}.", f"{o}experts.{e}."
        if fused in state:
            out[y + "gate_up_proj"] = state[fused][e]
            out[y + "down_proj"] = state[p + "experts.down_proj"][e]
            continue
        gate, up = state.pop(x + "gate_proj.weight"), state.pop(x + "up_proj.weight")
        out[y + "gate_up_proj"] = torch.cat([gate, up])
        out[y + "down_proj"] = state.pop(x + "down_proj.weight")
    state.pop(fused, None)
    state.pop(p + "experts.down_proj", None)
    if cfg.shared_expert_intermediate_size:
        x = p + "shared_expert."
        gate, up = state.pop(x + "gate_proj.weight"), state.pop(x + "up_proj.weight")
        out[o + "shared.gate_up_proj"] = torch.cat([gate, up])
        out[o + "shared.down_proj"] = state.pop(x + "down_proj.weight")
        out[o + "shared_gate"] = state.pop(p + "shared_expert_gate.weight")
    return out


def unfuse_projections(state: dict[str, Tensor], cfg: ModelConfig, prefix: str) -> None:
    """Qwen3-Next's DeltaNet projections as Qwen3.5 stores them, in ``state``: its
    ``in_proj_qkvz`` holds, per key head, that head's q, k, then its r = Hv / Hk value
    heads' v and z rows (``[Hk, 2 Dk + 2 r Dv, hidden]``), and ``in_proj_ba`` per key head
    its value heads' b then a rows (``[Hk, 2 r, hidden]``); Qwen3.5's ``in_proj_qkv`` is
    every q row, then every k, then every v, with z, b and a apart."""
    hk, hv = cfg.linear_key_heads, cfg.linear_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    qkvz = state.pop(prefix + "in_proj_qkvz.weight")
    q, k, v, z = qkvz.view(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
    state[prefix + "in_proj_qkv.weight"] = torch.cat(
        [t.reshape(-1, t.shape[-1]) for t in (q, k, v)]
    )
    state[prefix + "in_proj_z.weight"] = z.reshape(hv * dv, -1)
    b, a = state.pop(prefix + "in_proj_ba.weight").view(hk, 2 * r, -1).split([r, r], dim=1)
    state[prefix + "in_proj_b.weight"] = b.reshape(hv, -1)
    state[prefix + "in_proj_a.weight"] = a.reshape(hv, -1)


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    state = text_model_names(state)  # (a multimodal checkpoint's text model)
    out: dict[str, Tensor] = {}
    nh, hd = cfg.num_heads, cfg.head_dim
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        if cfg.moe_layer(i):
            out.update(experts_to_native(state, cfg, i))
        if cfg.recurrent(i) is not None:
            if cfg.architecture == "qwen3_next":
                unfuse_projections(state, cfg, p + "linear_attn.")
            out.update(deltanet.from_hf(state, p + "linear_attn.", o + "mixer."))
            continue
        q_gate = state.pop(p + "self_attn.q_proj.weight").view(nh, 2, hd, -1)
        state[p + "self_attn.q_proj.weight"] = q_gate[:, 0].reshape(nh * hd, -1)
        out[o + "attn_gate"] = q_gate[:, 1].reshape(nh * hd, -1)
    return {**_hf_to_native(state, cfg, Qwen3_5Names), **out}


MODEL = Qwen3_5Model
