"""LFM2 (Liquid AI): a hybrid of gated short convolutions and attention layers.

A convolution layer's mixer (``ShortConv``) projects ``x [T, h]`` to ``B, C, x'``
(``[T, h]`` each), convolves ``B * x'`` causally over the sequence, channel by channel
with a ``conv_kernel``-wide filter (its state: the last ``conv_kernel - 1`` inputs), and
gates the result with ``C``. The attention layers are the shared decoder's, with a q/k
RMSNorm per head (as Qwen3's). The final norm is the checkpoint's ``embedding_norm``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from structllm.kernels.packed import linear
from structllm.model.config import ModelConfig
from structllm.model.hybrid import HybridModel
from structllm.model.llama import HFNames
from structllm.model.llama import hf_to_native as _hf_to_native
from structllm.model.recurrent import RecurrentBatch, causal_conv1d


class ShortConv(nn.Module):
    PACKED = ("in_proj", "out_proj")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, k = cfg.hidden_size, cfg.conv_kernel

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.in_proj = p(3 * h, h)
        self.conv = p(h, k)  # [C, K]: channel c's filter, oldest input first
        self.out_proj = p(h, h)
        bias = cfg.conv_bias
        self.in_bias: nn.Parameter | None = p(3 * h) if bias else None
        self.conv_bias: nn.Parameter | None = p(h) if bias else None
        self.out_bias: nn.Parameter | None = p(h) if bias else None
        self.shape = (h, k - 1)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (self.shape,)

    def forward(self, x: Tensor, states: tuple[Tensor, ...], rb: RecurrentBatch) -> Tensor:
        b, c, u = linear(x, self.in_proj, self.in_bias).chunk(3, dim=-1)  # [T, h] each
        y = causal_conv1d(b * u, self.conv, self.conv_bias, states[0], rb)
        return linear(c * y, self.out_proj, self.out_bias)


class Lfm2Model(HybridModel):
    def mixer(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> nn.Module:
        return ShortConv(cfg, dtype)


class Lfm2Names(HFNames):
    o = "self_attn.out_proj"
    gate, up, down = "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"
    q_norm, k_norm = "self_attn.q_layernorm", "self_attn.k_layernorm"
    input_layernorm = "operator_norm"
    post_attention_layernorm = "ffn_norm"


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    state = dict(state)
    state["model.norm.weight"] = state.pop("model.embedding_norm.weight")
    out: dict[str, Tensor] = {}
    for i in range(cfg.num_layers):
        if cfg.recurrent(i) is None:
            continue
        p, o = f"model.layers.{i}.conv.", f"layers.{i}.mixer."
        out[o + "in_proj"] = state.pop(p + "in_proj.weight")
        out[o + "conv"] = state.pop(p + "conv.weight").squeeze(1)  # [C, 1, K] -> [C, K]
        out[o + "out_proj"] = state.pop(p + "out_proj.weight")
        if cfg.conv_bias:
            out[o + "in_bias"] = state.pop(p + "in_proj.bias")
            out[o + "conv_bias"] = state.pop(p + "conv.bias")
            out[o + "out_bias"] = state.pop(p + "out_proj.bias")
    return {**_hf_to_native(state, cfg, Lfm2Names), **out}


MODEL = Lfm2Model
