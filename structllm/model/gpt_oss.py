"""gpt-oss (``GptOssForCausalLM``): the Llama decoder with

- attention sinks: a learned logit per query head that joins each row's softmax
  denominator and weighs no value (``DecoderLayer.sinks``, passed to every attention
  backend, see ``kernels.attention.AttentionImpl``), and biases on q/k/v and o;
- windowed and global layers alternating (``config._layer_windows``; 128 keys in the
  released models), YaRN rotary;
- every MLP a mixture of experts (``GptOssMoe``): the router has a bias and its top-k
  weights are a softmax over the chosen logits; each expert has biases on both matrices
  and a clamped SwiGLU, ``(up + 1) * gate * sigmoid(alpha * gate)`` with ``gate``
  clamped above at ``limit`` and ``up`` to ``[-limit, limit]`` (``clamped_swiglu``).

On the fused CPU path the router, the activation and the experts run in ``cpu_moe.cpp``
(``route``'s softmax over the chosen logits, ``swiglu_clamp``, and the native expert call
with both biases when the experts are blocks); the per-expert loop calls the same
activation, so both give the same bits. The exact path keeps torch's ops.

The checkpoint's experts are 3-D tensors, ``gate_up_proj: [E, hidden, 2F]`` with gate
and up columns interleaved (gate at even columns), ``down_proj: [E, F, hidden]``;
``hf_to_native`` cuts them into one ``Expert`` each, ``gate_up_proj: [2F, hidden]`` as
gate rows then up rows, as every other family's, so the experts are ordinary weights
(packed, float16 or GGUF blocks like the rest). A checkpoint whose experts are MXFP4 (as
gpt-oss is published: ``*_blocks [E, N, K/32, 16]``, ``*_scales [E, N, K/32]``) keeps them
so, as MXFP4 ``BlockWeight``s in ggml's block layout (``mxfp4_experts``: the same codes
and exponents, reordered), run by the block kernels with no float copy; the exact path
and other devices take their float values (``loader.load_model``). The experts run
natively as above, and decode steps through the Python layer loop
(``decode_plan.why_not``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.packed import BlockWeight, linear
from structllm.model.config import ModelConfig
from structllm.model.layers import Expert, SparseMoe
from structllm.model.llama import DecoderLayer, HFNames
from structllm.model.llama import hf_to_native as _hf_to_native
from structllm.model.moe import MoeModel
from structllm.model.sharding import ShardPlan


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def clamped_swiglu(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    """``gate_up: [n, 2F]`` (gate columns, then up) -> ``[n, F]``, in transformers'
    order of operations (so the exact path rounds as it does)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExpert(Expert):
    """An ``Expert`` with a bias on each matrix: ``gate_up_bias: [2F]``, ``down_bias:
    [hidden]``."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype) -> None:
        super().__init__(hidden, ffn, dtype)
        self.gate_up_bias = _param(2 * ffn, dtype=dtype)
        self.down_bias = _param(hidden, dtype=dtype)


class GptOssMoe(SparseMoe):
    """``SparseMoe`` with gpt-oss's router (``router_bias: [E]``; softmax over the top k
    logits) and experts (``GptOssExpert``, ``clamped_swiglu``)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None = None) -> None:
        if plan is not None:  # (the biases would be added once per rank)
            raise ValueError("gpt-oss does not run with tensor parallelism yet")
        super().__init__(cfg, dtype, plan)
        self.experts = nn.ModuleList(
            GptOssExpert(cfg.hidden_size, self.ffn, dtype) for _ in range(cfg.num_experts)
        )
        self.router_bias = _param(cfg.num_experts, dtype=dtype)
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def native_act(self, act: str) -> bool:
        return True  # (its activation is its own, whatever the layer's act says)

    def native_extras(self) -> dict[str, Any]:
        """The experts' biases (``[E, 2F]``, ``[E, hidden]`` float32) and the clamped
        SwiGLU (act 1) for ``cpu_moe.cpp``'s ``Experts``."""
        experts = [cast(GptOssExpert, e) for e in self.experts]
        return {
            "gate_up_bias": torch.stack([e.gate_up_bias.float() for e in experts]).contiguous(),
            "down_bias": torch.stack([e.down_bias.float() for e in experts]).contiguous(),
            "act": 1,
            "alpha": self.alpha,
            "limit": self.limit,
        }

    def native_route(self) -> tuple[Tensor | None, bool] | None:
        return self.router_bias.float().contiguous(), True

    def route(self, h: Tensor, fused: bool) -> tuple[Tensor, Tensor]:
        """(weights, chosen), ``[T, k]`` each: the top k of ``h @ router^T + bias`` and
        the softmax over them (float32); on the fused CPU path by ``cpu_moe.cpp``'s
        ``route`` (both expert paths route alike, so they stay equal)."""
        module = _moe_module(h) if fused else None
        if module is not None and self.router.dtype == torch.float32:
            bias = self.router_bias.float().view(1, -1)
            w, c = module.route(h, self.router, self.top_k, False, bias, True)
            return cast(Tensor, w), cast(Tensor, c)
        logits = F.linear(h, self.router, self.router_bias)  # [T, E]
        top, chosen = logits.topk(self.top_k, dim=-1)
        return top.softmax(dim=-1, dtype=torch.float32), chosen

    def expert_mlp(
        self,
        expert: Expert,
        x: Tensor,
        act: str,
        fused_act: Callable[[Tensor], Tensor] | None,
    ) -> Tensor:
        assert isinstance(expert, GptOssExpert)
        gate_up = linear(x, expert.gate_up_proj, expert.gate_up_bias, int8_ok=True)  # [n, 2F]
        module = _moe_module(gate_up) if fused_act is not None else None
        if module is not None:  # the native call's activation (the same bits)
            mid = cast(Tensor, module.swiglu_clamp(gate_up, self.alpha, self.limit))
        else:
            mid = clamped_swiglu(gate_up, self.alpha, self.limit)
        return linear(mid, expert.down_proj, expert.down_bias, int8_ok=True)  # [n, hidden]


def _moe_module(x: Tensor) -> Any:
    """``cpu_moe.cpp``'s module for float32 CPU rows ``x``, or None."""
    if x.dtype != torch.float32 or not x.is_cpu:
        return None
    from structllm.kernels import cpu_ext

    return cpu_ext.load_moe()


class GptOssLayer(DecoderLayer):
    """``DecoderLayer`` with attention sinks (``sinks: [H]``, float32 as the kernels
    take them), ``o_proj``'s bias (``o_bias: [hidden]``) and ``GptOssMoe``."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None = None, index: int = 0
    ) -> None:
        super().__init__(cfg, dtype, plan, index)
        self.sinks = _param(cfg.num_heads, dtype=torch.float32)
        self.o_bias = _param(cfg.hidden_size, dtype=dtype)

    def make_moe(self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None) -> SparseMoe:
        return GptOssMoe(cfg, dtype, plan)


class GptOssModel(MoeModel):
    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        return GptOssLayer(cfg, dtype, plan, index)

    def assign_weights(self, weights: dict[str, Tensor | BlockWeight]) -> None:
        """As ``LlamaModel.assign_weights``, the sinks kept float32 (the kernels' type)."""
        super().assign_weights(
            {
                k: v.float() if k.endswith(".sinks") and isinstance(v, Tensor) else v
                for k, v in weights.items()
            }
        )


def mxfp4_experts(blocks: Tensor, scales: Tensor) -> list[BlockWeight]:
    """A checkpoint's MXFP4 tensor (``blocks [E, N, G, 16]`` uint8, byte j of a block
    holding element 2j in its low nibble and 2j + 1 in its high one; ``scales [E, N,
    G]``, E8M0 exponents) as one ``[N, 32 G]`` MXFP4 ``BlockWeight`` per expert in ggml's
    layout (the exponent byte, then byte j: element j low, j + 16 high). The codes and
    exponents are the same, so the values are transformers' (``convert_moe_packed_
    tensors``: its E2M1 table times ``2^(e - 127)``, ggml's doubled table times half)."""
    e, n, g = scales.shape
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [E, N, G, 32]
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    raw = torch.cat([scales.to(torch.uint8).unsqueeze(-1), nibbles], dim=-1)  # [E, N, G, 17]
    return [
        BlockWeight(raw[i].reshape(n, g * 17).contiguous(), "MXFP4", (n, g * 32)) for i in range(e)
    ]


def _experts(
    state: dict[str, Tensor], x: str, num: int
) -> tuple[list[Tensor | BlockWeight], list[Tensor | BlockWeight]]:
    """Layer prefix ``x``'s experts, ``([2F, hidden] gate rows then up rows, [hidden, F])``
    each: from float tensors (``gate_up_proj [E, hidden, 2F]``, gate and up columns
    interleaved; ``down_proj [E, F, hidden]``) or MXFP4 ones (``*_blocks``, ``*_scales``,
    stored ``[E, out, in]``, gate and up rows interleaved)."""
    if x + "gate_up_proj_blocks" in state:
        gu = mxfp4_experts(
            state.pop(x + "gate_up_proj_blocks"), state.pop(x + "gate_up_proj_scales")
        )
        rows = torch.arange(gu[0].shape[0]).view(-1, 2).t().reshape(-1)  # even rows, then odd
        downs = mxfp4_experts(state.pop(x + "down_proj_blocks"), state.pop(x + "down_proj_scales"))
        return [w.select_rows(rows) for w in gu], list(downs)
    gate_up = state.pop(x + "gate_up_proj")  # [E, hidden, 2F], gate/up interleaved
    down = state.pop(x + "down_proj")  # [E, F, hidden]
    gus: list[Tensor | BlockWeight] = []
    for e in range(num):
        w = gate_up[e].t()  # [2F, hidden]
        gus.append(torch.cat([w[0::2], w[1::2]]))
    return gus, [down[e].t().contiguous() for e in range(num)]


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor | BlockWeight]:
    """Llama's names for attention and norms; per layer the sinks, o's bias, the router
    and its bias, and the 3-D expert tensors cut into one expert each (gate and up
    de-interleaved into gate rows then up rows; MXFP4 ones as MXFP4 blocks)."""
    out: dict[str, Tensor | BlockWeight] = {}
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        out[o + "sinks"] = state.pop(p + "self_attn.sinks")
        out[o + "o_bias"] = state.pop(p + "self_attn.o_proj.bias")
        out[o + "moe.router"] = state.pop(p + "mlp.router.weight")
        out[o + "moe.router_bias"] = state.pop(p + "mlp.router.bias")
        x = p + "mlp.experts."
        gate_up, down = _experts(state, x, cfg.num_experts)
        gate_up_bias = state.pop(x + "gate_up_proj_bias")  # [E, 2F], gate/up interleaved
        down_bias = state.pop(x + "down_proj_bias")  # [E, hidden]
        for e in range(cfg.num_experts):
            b = gate_up_bias[e]
            ours = f"{o}moe.experts.{e}."
            out[ours + "gate_up_proj"] = gate_up[e]
            out[ours + "gate_up_bias"] = torch.cat([b[0::2], b[1::2]])
            out[ours + "down_proj"] = down[e]
            out[ours + "down_bias"] = down_bias[e]
    return {**_hf_to_native(state, cfg, HFNames), **out}


MODEL = GptOssModel
