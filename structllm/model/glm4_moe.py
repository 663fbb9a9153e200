"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (``Glm4MoeForCausalLM``): the Llama decoder with
q/k/v biases (``attention_bias``), optional per-head q/k norms (``use_qk_norm``), a
partial rotary embedding (``partial_rotary_factor``, the first half of each head, in
Hugging Face's halves layout: its q/k rows are permuted like Llama's), dense MLPs in the
first ``first_k_dense_replace`` layers and a mixture of experts in the rest
(``GroupedSigmoidMoe``).

The experts are routed as DeepSeek-V3's (``moe.sigmoid_group_route``): sigmoid scores, a
per-expert correction bias for the choice only, ``n_group`` groups of which the
``topk_group`` best are chosen from, the chosen scores renormalised (``norm_topk_prob``)
and times ``routed_scaling_factor``; beside them ``n_shared_experts`` shared experts
(one MLP ``moe_intermediate_size * n_shared_experts`` wide) run on every token,
ungated. Published checkpoints carry multi-token-prediction layers after the decoder's
(``model.layers.{num_hidden_layers}...``, ``num_nextn_predict_layers``): not run, not
loaded (``hf_to_native`` and the GGUF loader take the decoder's layers only).

The routing is Python's on every path: the native decode loop leaves such layers' MLPs
to ``SparseMoe.forward`` (``decode_plan._native_experts``), whose experts still run
through the native expert call where their weights allow.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from structllm.kernels.packed import BlockWeight
from structllm.model.config import ModelConfig
from structllm.model.layers import SparseMoe
from structllm.model.llama import DecoderLayer, HFNames
from structllm.model.llama import hf_to_native as _hf_to_native
from structllm.model.moe import GroupPick, MoeModel, sigmoid_group_route
from structllm.model.sharding import ShardPlan


class GroupedSigmoidMoe(SparseMoe):
    """``SparseMoe`` routed by ``sigmoid_group_route`` (``router_bias: [E]``, float32, the
    checkpoint's ``e_score_correction_bias``), its shared expert ungated."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None = None) -> None:
        super().__init__(cfg, dtype, plan)
        self.shared_gate = None  # (GLM's shared experts are added as they are)
        self.router_bias = nn.Parameter(
            torch.empty(cfg.num_experts, dtype=torch.float32), requires_grad=False
        )
        self.pick = GroupPick.of(cfg)

    def route(self, h: Tensor, fused: bool) -> tuple[Tensor, Tensor]:
        """(weights, chosen), ``[T, k]`` each, in float32 as transformers routes."""
        return sigmoid_group_route(h, self.router, self.router_bias, self.pick)


class Glm4MoeLayer(DecoderLayer):
    def make_moe(self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None) -> SparseMoe:
        return GroupedSigmoidMoe(cfg, dtype, plan)


class Glm4MoeModel(MoeModel):
    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        return Glm4MoeLayer(cfg, dtype, plan, index)

    def assign_weights(self, weights: dict[str, Tensor | BlockWeight]) -> None:
        """As ``LlamaModel.assign_weights``, the router biases kept float32."""
        super().assign_weights(
            {
                k: v.float() if k.endswith(".router_bias") and isinstance(v, Tensor) else v
                for k, v in weights.items()
            }
        )


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Llama's names for attention, norms and the dense layers; per MoE layer the
    router and its correction bias, the shared experts (gate and up fused) and each
    routed expert. Tensors of layers past ``num_layers`` (multi-token prediction) are
    left out."""
    moe_state: dict[str, Tensor] = {}
    for i in range(cfg.num_layers):
        if not cfg.moe_layer(i):
            continue
        p, o = f"model.layers.{i}.mlp.", f"layers.{i}.moe."
        moe_state[o + "router"] = state.pop(p + "gate.weight")
        moe_state[o + "router_bias"] = state.pop(p + "gate.e_score_correction_bias")
        experts = (
            [(p + "shared_experts.", o + "shared.")] if cfg.shared_expert_intermediate_size else []
        )
        experts += [(f"{p}experts.{e}.", f"{o}experts.{e}.") for e in range(cfg.num_experts)]
        for theirs, ours in experts:
            gate, up = state.pop(theirs + "gate_proj.weight"), state.pop(theirs + "up_proj.weight")
            moe_state[ours + "gate_up_proj"] = torch.cat([gate, up])
            moe_state[ours + "down_proj"] = state.pop(theirs + "down_proj.weight")
    return {**_hf_to_native(state, cfg, HFNames), **moe_state}


MODEL = Glm4MoeModel
