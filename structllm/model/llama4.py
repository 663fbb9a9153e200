"""Llama 4 (``Llama4ForCausalLM``; ``Llama4ForConditionalGeneration``'s text model:
Scout, Maverick): the Llama decoder with

- chunked local attention on the layers with rotary embeddings (``DecoderLayer.chunk``:
  a query at position ``p`` sees keys ``floor(p / C) * C .. p``, a rule of every
  attention backend, ``kernels.attention``), their q and k through a weightless per-head
  RMSNorm (transformers' L2 norm, after rotation there; a rotation keeps each head's
  norm, so ours, before it as every family's, is the same: weights of ones);
- global layers without rotary (every fourth, ``no_rope_layers``) whose queries are
  scaled by the attention temperature ``1 + attn_scale * log1p(floor((p + 1) /
  floor_scale))`` (``QueryTemperature``, set per step from the positions);
- a mixture of experts (``Llama4Moe``) in the ``moe_layers``: each token's top expert
  by router logit, its input (not its output) scaled by the sigmoid of that logit,
  beside an ungated shared expert; dense layers' MLPs ``intermediate_size_mlp`` wide.

Its rotary pairs ``x[2i]`` with ``x[2i + 1]`` (complex pairs, ours), so q/k rows are
not permuted. The checkpoint's experts are 3-D tensors, ``gate_up_proj: [E, hidden, 2F]``
(gate columns, then up) and ``down_proj: [E, F, hidden]``, cut here into one ``Expert``
each. The native decode loop declines the chunked and temperature layers (Python's
layer loop runs decode steps, ``decode_plan.why_not``).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.attention import AttentionMetadata
from structllm.model.config import ModelConfig
from structllm.model.layers import SparseMoe
from structllm.model.llama import DecoderLayer, HFNames, text_model_names
from structllm.model.llama import hf_to_native as _hf_to_native
from structllm.model.moe import MoeModel
from structllm.model.sharding import ShardPlan


class QueryTemperature:
    """The attention temperature of one step's queries, shared by the model's layers
    without rotary: ``set`` from the step's positions, then each such layer's
    ``DecoderLayer.scale_queries``."""

    def __init__(self, floor: int, scale: float) -> None:
        self.floor, self.scale = floor, scale
        self.scales: Tensor | None = None  # [T, 1, 1] float32

    def set(self, positions: Tensor) -> None:
        """``positions: [T]`` -> the step's scales, in transformers' float32 order."""
        p = positions.float()
        self.scales = (torch.log1p(torch.floor((p + 1.0) / self.floor)) * self.scale + 1.0)[
            :, None, None
        ]

    def apply(self, qkv: Tensor, num_heads: int) -> None:
        """Scale the queries of ``qkv: [T, H + 2 Hkv, D]`` in place."""
        assert self.scales is not None, "QueryTemperature.set runs before the layers"
        qkv[:, :num_heads].mul_(self.scales)


class Llama4Moe(SparseMoe):
    """``SparseMoe`` routed as Llama 4's: the top expert of ``h @ router^T``, its input
    ``h`` times the sigmoid of that logit, its output unweighted; the shared expert
    (``shared``, no gate) on ``h`` itself, added."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None = None) -> None:
        super().__init__(cfg, dtype, plan)
        self.shared_gate = None

    def route(self, h: Tensor, fused: bool) -> tuple[Tensor, Tensor]:
        """(scores, chosen), ``[T, 1]`` each: the top logit's expert and its sigmoid."""
        top, chosen = F.linear(h, self.router).topk(self.top_k, dim=-1)
        return torch.sigmoid(top.float()).to(h.dtype), chosen

    def forward(
        self, h: Tensor, act: str, fused_act: Callable[[Tensor], Tensor] | None = None
    ) -> Tensor:
        scores, chosen = self.route(h, fused_act is not None)  # [T, 1] each
        ones = torch.ones_like(scores)  # (the expert's output is not weighted)
        routed = self.routed(h * scores, ones, chosen, act, fused_act)
        return self._add_shared(h, routed, act, fused_act)


class Llama4Layer(DecoderLayer):
    """``DecoderLayer`` with ``Llama4Moe``; without rotary: no q/k norms, and the
    queries scaled by the model's ``QueryTemperature`` (if it has one)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        plan: ShardPlan | None,
        index: int,
        temperature: QueryTemperature | None,
    ) -> None:
        super().__init__(cfg, dtype, plan, index)
        if not self.rotates and self.qk_norm != "none":
            del self.q_norm, self.k_norm
            self.qk_norm = "none"
        if not self.rotates and temperature is not None:
            nh = self.num_heads
            self.scale_queries = lambda qkv: temperature.apply(qkv, nh)

    def make_moe(self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None) -> SparseMoe:
        return Llama4Moe(cfg, dtype, plan)


class Llama4Model(MoeModel):
    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        if not hasattr(self, "temperature"):  # (first layer: before the layers exist)
            floor = cfg.attn_temperature_floor
            self.temperature = (
                QueryTemperature(floor, cfg.attn_temperature_scale) if floor else None
            )
        return Llama4Layer(cfg, dtype, plan, index, self.temperature)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, ...]],
        meta: AttentionMetadata,
        between_layers: Callable[[], None] | None = None,
        hidden: Tensor | None = None,
    ) -> Tensor:
        """``LlamaModel.forward``, the step's query temperatures set first."""
        if self.temperature is not None:
            self.temperature.set(positions)
        return super().forward(input_ids, positions, kv_caches, meta, between_layers, hidden)


class Llama4Names(HFNames):
    gate, up, down = "feed_forward.gate_proj", "feed_forward.up_proj", "feed_forward.down_proj"
    rope_interleaved = True


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Llama's names for attention, norms and the dense MLPs (a multimodal checkpoint's
    text model by its own names); per MoE layer the router, the shared expert and the
    3-D expert tensors cut into one expert each; q/k norm weights of ones on the rotary
    layers (transformers' norm there has none)."""
    state = text_model_names(state)
    out: dict[str, Tensor] = {}
    f = cfg.moe_intermediate_size
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.feed_forward.", f"layers.{i}."
        if cfg.qk_norm == "head" and cfg.rotates(i):
            out[o + "q_norm"] = out[o + "k_norm"] = torch.ones(cfg.head_dim)
        if not cfg.moe_layer(i):
            continue
        out[o + "moe.router"] = state.pop(p + "router.weight")
        s = p + "shared_expert."
        gate, up = state.pop(s + "gate_proj.weight"), state.pop(s + "up_proj.weight")
        out[o + "moe.shared.gate_up_proj"] = torch.cat([gate, up])
        out[o + "moe.shared.down_proj"] = state.pop(s + "down_proj.weight")
        gate_up = state.pop(p + "experts.gate_up_proj")  # [E, hidden, 2F]: gate, then up
        down = state.pop(p + "experts.down_proj")  # [E, F, hidden]
        for e in range(cfg.num_experts):
            out[f"{o}moe.experts.{e}.gate_up_proj"] = gate_up[e].t().contiguous()  # [2F, hidden]
            out[f"{o}moe.experts.{e}.down_proj"] = down[e].t().contiguous()  # [hidden, F]
        assert gate_up.shape[-1] == 2 * f
    plain = msgspec.structs.replace(cfg, qk_norm="none")  # (the norms: ones, above)
    return {**_hf_to_native(state, plain, Llama4Names), **out}


MODEL = Llama4Model
