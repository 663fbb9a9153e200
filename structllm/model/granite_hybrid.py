"""Granite 4 (``GraniteMoeHybridForCausalLM``): Mamba-2 layers (``model.mamba2``) beside
attention layers, with Granite's multipliers (``model.granite``): embeddings times
``embedding_multiplier``, each mixer and MLP output times ``residual_multiplier``
before its residual, ``attention_multiplier`` as the softmax scale, logits divided by
``logits_scaling``. Its attention rotates q and k only with ``position_embedding_type``
"rope" (the hybrids are NoPE: ``ModelConfig.rope_layers`` all False).

Each layer's MLP is the checkpoint's ``shared_mlp`` (``input_linear``: gate rows then
up rows; ``output_linear``), the whole MLP of the dense models (``num_local_experts``
0: granite-4.0-h-micro, granite-4.0-micro); the mixture-of-experts variants are refused
when the config is read. A Granite 4 config with attention layers only (granite-4.0-
micro) runs as the plain decoder (``GraniteModel``), with its fast paths.
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
from structllm.model.layers import gated_act
from structllm.model.llama import DecoderLayer, HFNames, LlamaModel
from structllm.model.llama import hf_to_native as _hf_to_native
from structllm.model.recurrent import RecurrentBatch
from structllm.model.sharding import ShardPlan


class GraniteRecurrentLayer(RecurrentLayer):
    """``RecurrentLayer`` with each branch's output times ``residual_multiplier``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, mixer: nn.Module, index: int) -> None:
        super().__init__(cfg, dtype, mixer, index)
        self.residual_scale = cfg.residual_scale

    def forward(self, x: Tensor, states: tuple[Tensor, ...], rb: RecurrentBatch) -> Tensor:
        r = self.residual_scale
        h = F.rms_norm(x, (x.shape[-1],), self.input_layernorm, self.eps)
        x = x + r * cast(Mixer, self.mixer)(h, states, rb)
        h = F.rms_norm(x, (x.shape[-1],), self.post_attention_layernorm, self.eps)
        gate, up = linear(h, self.gate_up_proj, int8_ok=True).chunk(2, dim=-1)
        return x + r * linear(gated_act(gate, up, self.act), self.down_proj, int8_ok=True)


class GraniteHybridModel(HybridModel):
    def mixer(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> nn.Module:
        return mamba2.Mamba2(
            cfg.hidden_size,
            cfg.mamba_heads,
            cfg.mamba_head_dim,
            cfg.mamba_groups,
            cfg.mamba_d_state,
            cfg.conv_kernel,
            cfg.mamba_chunk_size,
            cfg.rms_norm_eps,
            conv_bias=cfg.conv_bias,
            proj_bias=cfg.mamba_proj_bias,
            dtype=dtype,
        )

    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        if cfg.recurrent(index) is None:
            return DecoderLayer(cfg, dtype, plan, index)
        return GraniteRecurrentLayer(cfg, dtype, self.mixer(cfg, dtype, index), index)


class GraniteHybridNames(HFNames):
    gate_up, down = "shared_mlp.input_linear", "shared_mlp.output_linear"


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    state = dict(state)
    out: dict[str, Tensor] = {}
    for i in range(cfg.num_layers):
        if cfg.recurrent(i) is not None:
            out.update(mamba2.from_hf(state, f"model.layers.{i}.mamba.", f"layers.{i}.mixer."))
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
