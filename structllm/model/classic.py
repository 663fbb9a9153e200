"""The classic decoder layouts (StableLM, Phi-2, GPT-NeoX): the shared decoder's
attention (``DecoderLayer.self_attention``) in a layer whose norms are LayerNorms with
a bias (``ModelConfig.norm_kind``, ``norm_bias``), whose MLP may be ungated
(``act(up(h)) -> down``, ``mlp_gated``) with biases (``mlp_bias``), and whose attention
and MLP may sit side by side on the residual (``parallel_block``):

- "none": ``x += attn(n1(x)); x += mlp(n2(x))``;
- "shared": ``x + attn(n1(x)) + mlp(n1(x))`` (Phi-2, StableLM's ``use_parallel_residual``);
- "separate": ``x + attn(n1(x)) + mlp(n2(x))`` (GPT-NeoX's ``use_parallel_residual``).

Norm biases are parameters of their own beside the weights (``input_layernorm_bias``,
``post_attention_layernorm_bias``, ``norm_bias``); the attention output's bias
(``o_bias``) and the LM head's (``lm_head_bias``) are the shared decoder's.

These layers run on the plain torch path only: the fused CPU ops (``cpu_layer.cpp``)
have no LayerNorm, ungated MLP or parallel block, so ``ClassicModel.use_cpu_ops``
declines them (said on stderr at start) and the quantized formats run their block
matrices through the same ``linear`` without the fused glue.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

from structllm.kernels.attention import AttentionImpl, AttentionMetadata
from structllm.kernels.packed import Weight, linear
from structllm.model.collectives import TensorParallelGroup
from structllm.model.config import ModelConfig
from structllm.model.layers import activation, norm
from structllm.model.llama import DecoderLayer, LlamaModel
from structllm.model.sharding import ShardPlan


def _param(dtype: torch.dtype, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ClassicLayer(DecoderLayer):
    """One layer of a classic layout (see the module docstring). An ungated MLP holds
    ``up_proj [F, hidden]`` and ``down_proj [hidden, F]`` (with ``up_bias [F]``,
    ``down_bias [hidden]``); a gated one the shared ``gate_up_proj``."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None = None, index: int = 0
    ) -> None:
        super().__init__(cfg, dtype, plan, index)
        h = cfg.hidden_size
        ffn = len(plan.ffn) if plan else cfg.intermediate_size
        self.norm_kind, self.parallel = cfg.norm_kind, cfg.parallel_block
        self.gated = cfg.mlp_gated
        self.input_layernorm_bias = _param(dtype, h) if cfg.norm_bias else None
        if self.parallel == "shared":  # one norm feeds both
            del self.post_attention_layernorm
            self.post_attention_layernorm = None
        self.post_attention_layernorm_bias = (
            _param(dtype, h)
            if cfg.norm_bias and self.post_attention_layernorm is not None
            else None
        )
        if not self.gated:
            del self.gate_up_proj
            self.up_proj: Weight = _param(dtype, ffn, h)
        self.up_bias = _param(dtype, (2 if self.gated else 1) * ffn) if cfg.mlp_bias else None
        self.down_bias = _param(dtype, h) if cfg.mlp_bias else None
        up = "gate_up_proj" if self.gated else "up_proj"
        self.PACKED = ("qkv_proj", "o_proj", up, "down_proj")

    def _ln(self, x: Tensor, w: Tensor | None, b: Tensor | None) -> Tensor:
        assert w is not None
        return norm(x, w, b, self.eps, self.norm_kind)

    def forward(
        self,
        x: Tensor,
        rope: Tensor | None,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        impl: AttentionImpl,
        tp: TensorParallelGroup | None = None,
    ) -> Tensor:
        """``x: [T, hidden]`` -> ``[T, hidden]``, as ``DecoderLayer.forward``."""
        h = self._ln(x, self.input_layernorm, self.input_layernorm_bias)
        attn_out = self.self_attention(h, rope, k_cache, v_cache, meta, impl, tp)
        if self.parallel == "none":
            x = x + attn_out
            return x + self.mlp(
                self._ln(x, self.post_attention_layernorm, self.post_attention_layernorm_bias), tp
            )
        if self.parallel == "separate":
            h = self._ln(x, self.post_attention_layernorm, self.post_attention_layernorm_bias)
        return x + attn_out + self.mlp(h, tp)

    def mlp(self, h: Tensor, tp: TensorParallelGroup | None) -> Tensor:
        """The MLP of the normed ``h [T, hidden]`` -> ``[T, hidden]`` (all-reduced with
        ``tp``, then its output bias added once)."""
        if self.gated:
            gate, up = linear(h, self.gate_up_proj, self.up_bias, int8_ok=True).chunk(2, dim=-1)
            mid = activation(gate, self.act).mul_(up)
        else:
            mid = activation(linear(h, self.up_proj, self.up_bias, int8_ok=True), self.act)
        out = linear(mid, self.down_proj, int8_ok=True)
        if tp is not None:
            tp.all_reduce(out)
        return out if self.down_bias is None else out.add_(self.down_bias)


class ClassicModel(LlamaModel):
    """``LlamaModel`` of ``ClassicLayer``s, its final norm a LayerNorm where the
    family's are (``norm_bias`` its bias), an LM head bias where it has one."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        plan: ShardPlan | None = None,
        layers: range | None = None,
    ) -> None:
        super().__init__(cfg, dtype, plan, layers)
        self.norm_bias = _param(dtype, cfg.hidden_size) if cfg.norm_bias else None
        if cfg.head_bias:
            self.lm_head_bias = _param(dtype, len(plan.vocab) if plan else cfg.vocab_size)

    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        return ClassicLayer(cfg, dtype, plan, index)

    def final_norm(self, x: Tensor) -> Tensor:
        return norm(x, self.norm, self.norm_bias, self.cfg.rms_norm_eps, self.cfg.norm_kind)

    def use_cpu_ops(self) -> bool:
        """Declined: the fused ops do not have these layers' norms and blocks (said once
        at start); the plain path runs them, block matrices included."""
        sys.stderr.write(
            f"structllm: {self.cfg.architecture}: the fused CPU layer ops do not run its "
            "layers (LayerNorm, biases, parallel blocks): the plain torch path runs them\n"
        )
        return False


def from_hf_norms(
    state: dict[str, Tensor], out: dict[str, Tensor], cfg: ModelConfig, names: dict[str, str]
) -> None:
    """Each of our norm tensors (``names``: ours -> the checkpoint's module under
    ``model.layers.{i}.``, ``{i}`` filled in) and its bias where the family has them,
    popped from ``state`` into ``out``."""
    for i in range(cfg.num_layers):
        for ours, theirs in names.items():
            p = theirs.format(i=i)
            out[f"layers.{i}.{ours}"] = state.pop(p + ".weight")
            if cfg.norm_bias:
                out[f"layers.{i}.{ours}_bias"] = state.pop(p + ".bias")


MODEL = ClassicModel
