"""Mixture-of-experts decoders, Mixtral, Qwen3-MoE and Qwen2-MoE: the Llama decoder
(Qwen3's q/k norms for Qwen3-MoE, Qwen2's q/k/v biases for Qwen2-MoE) whose MLP is a
router and ``num_experts`` gated MLPs, of which each token runs its top
``num_experts_per_tok``, weighted by the router's softmax (renormalised over the chosen
ones: always for Mixtral, ``norm_topk_prob`` for the Qwen ones). Qwen2-MoE adds a shared
expert every token runs, scaled by a sigmoid gate of its own (``SparseMoe.shared``).

The experts run grouped by expert (``layers.SparseMoe.forward``): the step's (token, choice)
pairs are sorted by expert, and each expert's tokens go through its two matmuls at once,
so a step costs its active parameters and one matmul per expert used, not a loop over
tokens. Each expert's matrices are ordinary weights (``linear``: oneDNN, float16 rows
(``HalfMatrix``) or GGUF blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from structllm.model.config import ModelConfig
from structllm.model.layers import SparseMoe
from structllm.model.llama import HFNames, LlamaModel, text_model_names
from structllm.model.llama import hf_to_native as _hf_to_native


@dataclass(frozen=True)
class GroupPick:
    """How a grouped router picks (DeepSeek's, GLM-4.5's, Nemotron 3's): ``top_k``
    experts from the ``groups_used`` best of ``groups`` equal runs of experts, their
    weights over their sum with ``renormalise``, times ``scale``
    (``routed_scaling_factor``)."""

    top_k: int
    groups: int = 1
    groups_used: int = 1
    renormalise: bool = True
    scale: float = 1.0

    @classmethod
    def of(cls, cfg: ModelConfig) -> GroupPick:
        return cls(
            cfg.num_experts_per_tok,
            cfg.expert_groups,
            cfg.expert_groups_used,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )


def sigmoid_group_route(
    h: Tensor, router: Tensor, bias: Tensor, pick: GroupPick
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3's routing (also Nemotron 3's, GLM-4.5's): ``h [T, hidden]``,
    ``router [E, hidden]``, ``bias [E]`` (``e_score_correction_bias``) -> (weights,
    chosen), ``[T, k]`` each, in float32 as transformers' ``DeepseekV3TopkRouter``.
    Scores are the logits' sigmoid; the choice is by score plus ``bias``, among the
    experts of the groups whose two best biased scores sum highest; the weights are the
    chosen experts' unbiased scores (``pick`` says how many, and how they are scaled)."""
    t, e = h.shape[0], router.shape[0]
    scores = F.linear(h.float(), router.float()).sigmoid()  # [T, E]
    choice = scores + bias.float()
    if pick.groups > 1:
        by_group = choice.view(t, pick.groups, e // pick.groups)  # [T, G, E/G]
        best = by_group.topk(2, dim=-1)[0].sum(-1)  # [T, G]
        choice = _keep_groups(by_group, best, pick.groups_used, float("-inf")).view(t, e)
    chosen = choice.topk(pick.top_k, dim=-1)[1]  # [T, k]
    return _weights(scores.gather(1, chosen), pick), chosen


def softmax_group_route(h: Tensor, router: Tensor, pick: GroupPick) -> tuple[Tensor, Tensor]:
    """DeepSeek-V2's routing (``topk_method`` "greedy", or with ``groups > 1``
    "group_limited_greedy"): the logits' softmax over all experts (float32); the top k
    among the experts of the groups whose best score is highest, those scores as
    weights (as ``pick`` says)."""
    t, e = h.shape[0], router.shape[0]
    scores = F.linear(h.float(), router.float()).softmax(-1)  # [T, E]
    if pick.groups > 1:
        by_group = scores.view(t, pick.groups, e // pick.groups)  # [T, G, E/G]
        scores = _keep_groups(by_group, by_group.amax(-1), pick.groups_used, 0.0).view(t, e)
    weights, chosen = scores.topk(pick.top_k, dim=-1)  # [T, k] each
    return _weights(weights, pick), chosen


def _weights(weights: Tensor, pick: GroupPick) -> Tensor:
    if pick.renormalise:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * pick.scale


def native_group_route(
    native: Any, h: Tensor, router: Tensor, bias: Tensor | None, sigmoid: bool, pick: GroupPick
) -> tuple[Tensor, Tensor] | None:
    """``sigmoid_group_route`` (``sigmoid``) or ``softmax_group_route`` in one call of
    cpu_mla.cpp's ``group_route`` (``native``: its module, as the native decode loop
    calls it), or None where it does not take these tensors (not float32 on the CPU, a
    router that is not contiguous): the caller routes with torch."""
    if native is None or h.dtype != torch.float32 or router.dtype != torch.float32:
        return None
    if not router.is_contiguous() or (bias is not None and bias.dtype != torch.float32):
        return None
    p = pick
    return cast(
        tuple[Tensor, Tensor],
        native.group_route(
            h.contiguous(),
            router,
            bias,
            sigmoid,
            p.groups,
            p.groups_used,
            p.top_k,
            p.renormalise,
            p.scale,
        ),
    )


def _keep_groups(by_group: Tensor, group_scores: Tensor, used: int, fill: float) -> Tensor:
    """``by_group [T, G, E/G]`` with every group but the ``used`` best of
    ``group_scores [T, G]`` (per token) filled with ``fill``."""
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(used, dim=-1)[1], True)
    return by_group.masked_fill(~keep[..., None], fill)


class MoeModel(LlamaModel):
    """``LlamaModel`` whose MoE layers (``ModelConfig.moe_layer``) hold a ``SparseMoe``."""

    def pack_weights(self, half: str = "none") -> None:
        """As ``LlamaModel.pack_weights``, except that experts it would run as fbgemm
        float16 become ``HalfMatrix`` first (``SparseMoe.half_experts``): float16 rows
        that the native expert call runs (cpu_moe.cpp), as it runs GGUF blocks."""
        if self.norm.device.type == "cpu" and half != "none":
            for m in self.modules():
                if isinstance(m, SparseMoe):
                    m.half_experts(half)
        super().pack_weights(half)


class MixtralNames(HFNames):
    router = "block_sparse_moe.gate"
    expert = "block_sparse_moe.experts.{e}"
    expert_gate, expert_up, expert_down = "w1", "w3", "w2"


class Qwen3MoeNames(HFNames):
    router = "mlp.gate"
    expert = "mlp.experts.{e}"
    expert_gate, expert_up, expert_down = "gate_proj", "up_proj", "down_proj"


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """The dense tensors as Llama's, then each MoE layer's router and experts."""
    names = MixtralNames if cfg.architecture == "mixtral" else Qwen3MoeNames
    state = text_model_names(state)  # (Qwen3-VL-MoE's text model: model.language_model.)
    moe_state: dict[str, Tensor] = {}
    for i in range(cfg.num_layers):  # take the MoE tensors out before the dense mapping
        if not cfg.moe_layer(i):
            continue
        p, o = f"model.layers.{i}.", f"layers.{i}.moe."
        moe_state[o + "router"] = state.pop(f"{p}{names.router}.weight")
        if cfg.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert and its gate
            x = p + "mlp.shared_expert."
            gate, up = state.pop(f"{x}gate_proj.weight"), state.pop(f"{x}up_proj.weight")
            moe_state[o + "shared.gate_up_proj"] = torch.cat([gate, up])
            moe_state[o + "shared.down_proj"] = state.pop(f"{x}down_proj.weight")
            moe_state[o + "shared_gate"] = state.pop(f"{p}mlp.shared_expert_gate.weight")
        fused = state.pop(p + "mlp.experts.gate_up_proj", None)
        if fused is not None:  # Qwen3-VL-MoE's: every expert in one tensor
            down = state.pop(p + "mlp.experts.down_proj")
            moe_state.update(_unfused(fused, down, cfg, o))
            continue
        for e in range(cfg.num_experts):
            x = p + names.expert.format(e=e) + "."
            gate = state.pop(f"{x}{names.expert_gate}.weight")
            up = state.pop(f"{x}{names.expert_up}.weight")
            moe_state[f"{o}experts.{e}.gate_up_proj"] = torch.cat([gate, up])
            moe_state[f"{o}experts.{e}.down_proj"] = state.pop(f"{x}{names.expert_down}.weight")
    return {**_hf_to_native(state, cfg, names), **moe_state}


def _unfused(gate_up: Tensor, down: Tensor, cfg: ModelConfig, o: str) -> dict[str, Tensor]:
    """Qwen3-VL-MoE's fused experts as each expert's ``gate_up_proj [2F, hidden]`` (gate
    rows, then up) and ``down_proj [hidden, F]``. Two layouts, told by shape as
    transformers tells them (its ``Transpose(check_dims=True)``): the released files'
    input-major ``gate_up_proj [E, hidden, 2F]`` (gate then up along the last axis),
    ``down_proj [E, F, hidden]``, and what transformers 5 saves, its Linear layout
    ``[E, 2F, hidden]``, ``[E, hidden, F]``; where the shapes cannot tell (hidden = 2F),
    the released one."""
    e, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if tuple(gate_up.shape) == (e, h, 2 * f) and tuple(down.shape) == (e, f, h):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    elif tuple(gate_up.shape) != (e, 2 * f, h) or tuple(down.shape) != (e, h, f):
        raise ValueError(
            f"{o}: fused experts of shapes {list(gate_up.shape)} and {list(down.shape)}, "
            f"neither [{e}, {h}, {2 * f}] and [{e}, {f}, {h}] nor their transposes"
        )
    out: dict[str, Tensor] = {}
    for k in range(e):
        out[f"{o}experts.{k}.gate_up_proj"] = gate_up[k].contiguous()
        out[f"{o}experts.{k}.down_proj"] = down[k].contiguous()
    return out


MODEL = MoeModel
