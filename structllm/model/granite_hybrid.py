"""Granite 4 (``GraniteMoeHybridForCausalLM``): Mamba-2 layers (``model.mamba2``) beside
attention layers, with Granite's multipliers (``model.granite``): embeddings times
``embedding_multiplier``, each mixer and MLP output times ``residual_multiplier``
before its residual, ``attention_multiplier`` as the softmax scale, logits divided by
``logits_scaling``. Its attention rotates q and k only with ``position_embedding_type``
"rope" (the hybrids are NoPE: ``ModelConfig.rope_layers`` all False).

Each layer's MLP is the checkpoint's ``shared_mlp`` (``input_linear``: gate rows then
up rows; ``output_linear``), the whole MLP of the dense models (``num_local_experts``
0: granite-4.0-h-micro, granite-4.0-micro). In the mixture-of-experts models
(granite-4.0-h-tiny, -h-small) it is a shared expert beside the routed ones
(``SharedMoe``: ``layers.SparseMoe``, the top ``num_experts_per_tok`` of a softmax
renormalised, plus the shared MLP on every token). A Granite 4 config with attention
layers only (granite-4.0-micro) runs as the plain decoder (``GraniteModel``), with its
fast paths; one with experts but no Mamba layers is refused when the config is read.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.packed import linear
from structllm.model import mamba2
from structllm.model.config import ModelConfig
from structllm.model.granite import GraniteModel
from structllm.model.hybrid import HybridModel, Mixer, RecurrentLayer
from structllm.model.layers import Expert, SparseMoe, gated_act
from structllm.model.llama import DecoderLayer, HFNames, LlamaModel
from structllm.model.llama import hf_to_native as _hf_to_native
from structllm.model.recurrent import RecurrentBatch
from structllm.model.sharding import ShardPlan


class SharedMoe(SparseMoe):
    """Granite 4's MoE block: the routed experts (``SparseMoe``, each
    ``moe_intermediate_size`` wide) plus ``shared``, the shared MLP (``Expert``,
    ``intermediate_size`` wide) that every token runs, ungated (``SparseMoe._add_shared``
    adds it as it is, as GLM-4.5's)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype, None)
        self.shared = Expert(cfg.hidden_size, cfg.intermediate_size, dtype)


class GraniteRecurrentLayer(RecurrentLayer):
    """``RecurrentLayer`` with each branch's output times ``residual_multiplier`` and
    Granite's MoE block (``SharedMoe``) where the model has experts."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, mixer: nn.Module, index: int) -> None:
        super().__init__(cfg, dtype, mixer, index)
        self.residual_scale = cfg.residual_scale
        if self.moe is not None:  # (built on the meta device: replacing it is free)
            self.moe = SharedMoe(cfg, dtype)

    def forward(self, x: Tensor, states: tuple[Tensor, ...], rb: RecurrentBatch) -> Tensor:
        r = self.residual_scale
        h = F.rms_norm(x, (x.shape[-1],), self.input_layernorm, self.eps)
        x = x + r * cast(Mixer, self.mixer)(h, states, rb)
        h = F.rms_norm(x, (x.shape[-1],), self.post_attention_layernorm, self.eps)
        if self.moe is not None:
            return x + r * self.moe(h, self.act)
        gate, up = linear(h, self.gate_up_proj, int8_ok=True).chunk(2, dim=-1)
        return x + r * linear(gated_act(gate, up, self.act), self.down_proj, int8_ok=True)


class GraniteHybridModel(HybridModel):
    def mixer(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> nn.Module:
        return mamba2.Mamba2.from_model_config(cfg, dtype)

    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        if cfg.recurrent(index) is None:
            layer = DecoderLayer(cfg, dtype, plan, index)
            if layer.moe is not None:  # (built on the meta device: replacing it is free)
                layer.moe = SharedMoe(cfg, dtype)
            return layer
        return GraniteRecurrentLayer(cfg, dtype, self.mixer(cfg, dtype, index), index)


class GraniteHybridNames(HFNames):
    gate_up, down = "shared_mlp.input_linear", "shared_mlp.output_linear"


# the MoE block's tensors under model.layers.{i}.: as the checkpoints name them, and as
# transformers 5 names them in memory
_ROUTER = ("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight")
_EXPERTS_GATE_UP = (
    "block_sparse_moe.input_linear.weight",  # [E, 2F, hidden]: gate rows then up rows
    "block_sparse_moe.experts.gate_up_proj",
)
_EXPERTS_DOWN = ("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj")


def _take(state: dict[str, Tensor], prefix: str, names: tuple[str, ...]) -> Tensor:
    for name in names:
        if prefix + name in state:
            return state.pop(prefix + name)
    raise KeyError(f"{prefix}{names[0]}")


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    state = dict(state)
    out: dict[str, Tensor] = {}
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        if cfg.recurrent(i) is not None:
            out.update(mamba2.from_hf(state, p + "mamba.", o + "mixer."))
        if cfg.moe_layer(i):
            out[o + "moe.router"] = _take(state, p, _ROUTER)
            gate_up, down = _take(state, p, _EXPERTS_GATE_UP), _take(state, p, _EXPERTS_DOWN)
            for e in range(cfg.num_experts):
                out[f"{o}moe.experts.{e}.gate_up_proj"] = gate_up[e]
                out[f"{o}moe.experts.{e}.down_proj"] = down[e]
            out[o + "moe.shared.gate_up_proj"] = state.pop(p + "shared_mlp.input_linear.weight")
            out[o + "moe.shared.down_proj"] = state.pop(p + "shared_mlp.output_linear.weight")
    return {**_hf_to_native(state, cfg, GraniteHybridNames), **out}


def build(
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    plan: ShardPlan | None = None,
    layers: range | None = None,
) -> LlamaModel:
    """The hybrid model, or for a config without Mamba layers the plain decoder."""
    if cfg.hybrid:
        return GraniteHybridModel(cfg, dtype, plan, layers)
    return GraniteModel(cfg, dtype, plan, layers)


MODEL = build
