"""Nemotron-H (``NemotronHForCausalLM``: Nemotron-H 4B/8B/47B/56B, Nemotron Nano 2,
Nemotron 3): a stack of single-operation blocks, each ``x + op(rms_norm(x))``,
whose op is by the config's pattern (``ModelConfig.layer_types``, from the checkpoint's
"M-M-M*-..."):

- "mamba" (M): the Mamba-2 mixer Granite 4 uses (``model.mamba2``: its gated norm
  over ``n_groups`` groups), its state in ``engine.state_cache``;
- "attention" (*): NoPE attention over the paged KV cache, without biases (the shared
  decoder's attention, ``DecoderLayer.attend``, with no MLP after it);
- "mlp" (-): ``down(relu(up(h)) ** 2)``, not gated;
- "moe" (E, Nemotron 3): a mixture of such experts beside a shared one (``MoeBlock``).

An MLP or MoE layer neither attends nor keeps a state: no KV blocks and no state slot
(``HybridModel.state_shapes``: ``()``).

Hugging Face names: ``model.embeddings``, ``model.layers.{i}.norm`` and
``.mixer.*`` (the original checkpoints say ``backbone.`` for ``model.``),
``model.norm_f``, ``lm_head``. Nemotron 3's multi-token-prediction layers are not run.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.attention import AttentionImpl, AttentionMetadata
from structllm.kernels.packed import Weight, linear
from structllm.model import mamba2
from structllm.model.collectives import TensorParallelGroup
from structllm.model.config import ModelConfig
from structllm.model.hybrid import HybridModel, Mixer
from structllm.model.layers import native_experts_of
from structllm.model.llama import DecoderLayer
from structllm.model.moe import GroupPick, native_group_route, sigmoid_group_route
from structllm.model.recurrent import RecurrentBatch
from structllm.model.sharding import ShardPlan


def _param(dtype: torch.dtype, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class AttentionBlock(DecoderLayer):
    """Pre-norm (``input_layernorm``), attention, residual: the shared decoder layer's
    first half (``attend``; on the fused CPU path ``fused_attend``), its MLP's
    parameters dropped."""

    fused_block = True  # HybridModel._forward_fused runs forward_fused

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__(cfg, dtype, None, index)
        # (built on the meta device or not yet touched: dropping them is free)
        del self.gate_up_proj, self.down_proj, self.post_attention_layernorm
        self.post_attention_layernorm = None
        self.PACKED = ("qkv_proj", "o_proj")

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
        return self.attend(x, rope, k_cache, v_cache, meta, impl, tp)

    def forward_fused(
        self,
        x: Tensor,
        delta: Tensor | None,
        rope: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        impl: AttentionImpl,
        tp: TensorParallelGroup | None,
        ops: Any,
        o_out: Tensor | None = None,
    ) -> Tensor:
        """``DecoderLayer.forward_fused`` without the MLP: the attention's output is the
        next delta."""
        return self.fused_attend(x, delta, rope, k_cache, v_cache, meta, impl, tp, ops, o_out)


class MambaBlock(nn.Module):
    """Pre-norm, the Mamba-2 mixer over the slot's states, residual."""

    fused_block = True  # HybridModel._forward_fused runs forward_fused

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = _param(dtype, cfg.hidden_size)
        self.mixer = mamba2.Mamba2.from_model_config(cfg, dtype)

    def forward(self, x: Tensor, states: tuple[Tensor, ...], rb: RecurrentBatch) -> Tensor:
        h = F.rms_norm(x, (x.shape[-1],), self.input_layernorm, self.eps)
        return x + cast(Mixer, self.mixer)(h, states, rb)

    def forward_fused(
        self,
        x: Tensor,
        delta: Tensor | None,
        states: tuple[Tensor, ...],
        rb: RecurrentBatch,
        ops: Any,
    ) -> Tensor:
        """``forward`` with ``RecurrentLayer.forward_fused``'s residual contract: ``x +=
        delta`` fused with the pre-norm (``cpu_layer.cpp``); the mixer's output is the
        next delta."""
        h = ops.rms_norm(x, delta, self.input_layernorm, self.eps)
        return cast(Mixer, self.mixer)(h, states, rb)


def relu_squared_mlp(h: Tensor, up: Weight, down: Weight) -> Tensor:
    """``h [T, D]`` -> ``down(relu(up(h)) ** 2)`` ``[T, D]`` (``up [F, D]``, ``down
    [D, F]``): Nemotron-H's MLP, not gated."""
    return linear(F.relu(linear(h, up, int8_ok=True)).square(), down, int8_ok=True)


class MlpBlock(nn.Module):
    """Pre-norm, the relu-squared MLP (``up_proj [F, hidden]``, ``down_proj [hidden,
    F]``), residual. No state: ``states`` is the empty tuple."""

    PACKED = ("up_proj", "down_proj")
    fused_block = True  # HybridModel._forward_fused runs forward_fused

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = _param(dtype, h)
        self.up_proj: Weight = _param(dtype, f, h)
        self.down_proj: Weight = _param(dtype, h, f)

    def forward(self, x: Tensor, states: tuple[Tensor, ...], rb: RecurrentBatch) -> Tensor:
        h = F.rms_norm(x, (x.shape[-1],), self.input_layernorm, self.eps)
        return x + relu_squared_mlp(h, self.up_proj, self.down_proj)

    def forward_fused(
        self,
        x: Tensor,
        delta: Tensor | None,
        states: tuple[Tensor, ...],
        rb: RecurrentBatch,
        ops: Any,
    ) -> Tensor:
        """As ``MambaBlock.forward_fused``: the MLP's output is the next delta."""
        h = ops.rms_norm(x, delta, self.input_layernorm, self.eps)
        return relu_squared_mlp(h, self.up_proj, self.down_proj)


class ReluSquaredExpert(nn.Module):
    """One expert (or the shared one): ``up_proj [F, D]``, ``down_proj [D, F]``."""

    PACKED = ("up_proj", "down_proj")

    def __init__(self, width: int, ffn: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.up_proj: Weight = _param(dtype, ffn, width)
        self.down_proj: Weight = _param(dtype, width, ffn)


class MoeBlock(nn.Module):
    """Pre-norm, Nemotron 3's mixture of experts, residual. No state.

    ``router [E, hidden]`` and ``router_bias [E]`` (transformers'
    ``e_score_correction_bias``) choose each token's top k (``route``); the chosen
    experts (``ReluSquaredExpert``, ``moe_latent_size`` wide where the model has
    ``latent_down [L, hidden]`` and ``latent_up [hidden, L]`` around them, else
    ``hidden``) run grouped by expert, their outputs weighted and summed, plus the
    shared expert's on every token (on the norm's output, not the latent)."""

    fused_block = True  # HybridModel._forward_fused runs forward_fused

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, e, latent = cfg.hidden_size, cfg.num_experts, cfg.moe_latent_size
        self.eps = cfg.rms_norm_eps
        self.top_k = cfg.num_experts_per_tok
        self.pick = GroupPick.of(cfg)
        self.input_layernorm = _param(dtype, h)
        self.router = _param(dtype, e, h)
        self.router_bias = _param(dtype, e)
        width = latent or h
        self.width, self.ffn = width, cfg.moe_intermediate_size  # the experts' in/out, inner
        self.experts = nn.ModuleList(
            ReluSquaredExpert(width, cfg.moe_intermediate_size, dtype) for _ in range(e)
        )
        self.shared = ReluSquaredExpert(h, cfg.shared_expert_intermediate_size, dtype)
        self.latent_down: Weight | None = _param(dtype, latent, h) if latent else None
        self.latent_up: Weight | None = _param(dtype, h, latent) if latent else None
        self.PACKED = ("latent_down", "latent_up") if latent else ()
        self.native: Any = None  # cpu_moe.cpp's Experts, once built (False: not for these weights)
        self.native_router: Any = None  # cpu_mla.cpp's module (NemotronHModel.use_cpu_ops)

    def native_experts(self) -> Any:
        """cpu_moe.cpp's ``Experts`` over the experts' block or float16 weights (relu², its
        act 3; built on first use, after loading has packed them), or None (float32
        weights stay on torch's exact ops, or the kernel is missing)."""
        if self.native is None:
            experts = list(self.experts)
            extras = {"act": 3}
            self.native = native_experts_of(experts, self.width, self.ffn, extras, first="up_proj")
        return self.native or None

    def route(self, h: Tensor, fused: bool = False) -> tuple[Tensor, Tensor]:
        """``h [T, hidden]`` -> (weights, chosen), ``[T, k]`` each, as transformers'
        ``NemotronHTopkRouter`` (in float32): sigmoid scores; the choice by score plus
        ``router_bias``, among the experts of the ``groups_used`` groups whose two best
        biased scores sum highest; the chosen ones' unbiased scores as weights (over
        their sum with ``renormalise``), times ``scale``. On the fused CPU path
        (``fused``) by cpu_mla.cpp's ``group_route``, as the native decode loop routes."""
        if fused:
            routed = native_group_route(
                self.native_router, h, self.router, self.router_bias, True, self.pick
            )
            if routed is not None:
                return routed
        return sigmoid_group_route(h, self.router, self.router_bias, self.pick)

    def forward(self, x: Tensor, states: tuple[Tensor, ...], rb: RecurrentBatch) -> Tensor:
        h = F.rms_norm(x, (x.shape[-1],), self.input_layernorm, self.eps)
        return x + self.mlp(h, fused=False)

    def forward_fused(
        self,
        x: Tensor,
        delta: Tensor | None,
        states: tuple[Tensor, ...],
        rb: RecurrentBatch,
        ops: Any,
    ) -> Tensor:
        """As ``MambaBlock.forward_fused``: ``x += delta`` with the pre-norm; the block's
        output (routed plus shared) is the next delta. The kernels of the native decode
        loop's ``add_moe_block``, in its order."""
        h = ops.rms_norm(x, delta, self.input_layernorm, self.eps)
        return self.mlp(h, fused=True)

    def mlp(self, h: Tensor, fused: bool) -> Tensor:
        """The routed experts' weighted sum plus the shared expert's MLP, of the normed
        ``h [T, hidden]``."""
        weights, chosen = self.route(h, fused)
        u = h if self.latent_down is None else linear(h, self.latent_down)  # [T, L]
        native = self.native_experts() if u.dtype == torch.float32 and u.is_cpu else None
        if native is not None:  # one native call for every expert (cpu_moe.cpp): the same bits
            routed = cast(Tensor, native.forward(u, chosen, weights.float()))
        else:
            routed = self._routed(u, weights, chosen)
        if self.latent_up is not None:
            routed = linear(routed, self.latent_up)  # [T, hidden]
        return routed + relu_squared_mlp(h, self.shared.up_proj, self.shared.down_proj)

    def _routed(self, u: Tensor, weights: Tensor, chosen: Tensor) -> Tensor:
        """The routed experts' weighted sum of ``u [T, L]``, expert by expert."""
        flat = chosen.flatten()  # (token, choice) slots, sorted by expert below
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        routed = torch.zeros_like(u)
        start = 0
        w = weights.flatten()
        for i, n in enumerate(counts):  # experts in order, as transformers adds them
            if n == 0:
                continue
            slots = order[start : start + n]
            start += n
            rows = slots // self.top_k  # distinct tokens: a token picks an expert once
            expert = cast(ReluSquaredExpert, self.experts[i])
            y = relu_squared_mlp(u[rows], expert.up_proj, expert.down_proj)  # [n, L]
            routed.index_put_((rows,), y * w[slots, None].to(y.dtype), accumulate=True)
        return routed


class NemotronHModel(HybridModel):
    def use_cpu_ops(self) -> bool:
        """``LlamaModel.use_cpu_ops``, and with them cpu_mla.cpp's grouped router for
        Nemotron 3's MoE blocks (``MoeBlock.native_router``), as DeepSeek's."""
        on = super().use_cpu_ops()
        blocks = [m for m in self.layers if isinstance(m, MoeBlock)]
        if blocks:
            from structllm.kernels import cpu_ext

            router = cpu_ext.load_mla() if on else None
            for m in blocks:
                m.native_router = router
        return on

    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        if cfg.attends(index):
            return AttentionBlock(cfg, dtype, index)
        if cfg.moe_layer(index):
            return MoeBlock(cfg, dtype)
        if cfg.recurrent(index) is None:  # "mlp"
            return MlpBlock(cfg, dtype)
        return MambaBlock(cfg, dtype)


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    state = {
        ("model." + k.removeprefix("backbone.") if k.startswith("backbone.") else k): v
        for k, v in state.items()
    }
    out = {"embed_tokens": state.pop("model.embeddings.weight")}
    out["norm"] = state.pop("model.norm_f.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head"] = state.pop("lm_head.weight")
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        out[o + "input_layernorm"] = state.pop(p + "norm.weight")
        m = p + "mixer."
        if cfg.attends(i):  # q, k, v fused as ours (no rotary: rows as they are)
            qkv = [state.pop(f"{m}{n}_proj.weight") for n in "qkv"]
            out[o + "qkv_proj"] = torch.cat(qkv)
            out[o + "o_proj"] = state.pop(m + "o_proj.weight")
        elif cfg.moe_layer(i):
            out.update(_experts_from_hf(state, cfg, m, o))
        elif cfg.recurrent(i) is None:
            out[o + "up_proj"] = state.pop(m + "up_proj.weight")
            out[o + "down_proj"] = state.pop(m + "down_proj.weight")
        else:
            out.update(mamba2.from_hf(state, m, o + "mixer."))
    return out


def _experts_from_hf(
    state: dict[str, Tensor], cfg: ModelConfig, m: str, o: str
) -> dict[str, Tensor]:
    """One MoE layer's tensors (popped from ``state``, under ``m`` =
    ``model.layers.{i}.mixer.``) -> ours under ``o``: the checkpoints' experts one by
    one (``experts.{e}.up_proj.weight``), or transformers' in-memory 3-D ``[E, ...]``
    (``experts.up_proj``)."""
    out = {o + "router": state.pop(m + "gate.weight")}
    out[o + "router_bias"] = state.pop(m + "gate.e_score_correction_bias")
    for ours in ("up_proj", "down_proj"):
        stacked = state.pop(f"{m}experts.{ours}", None)
        for e in range(cfg.num_experts):
            w = stacked[e] if stacked is not None else state.pop(f"{m}experts.{e}.{ours}.weight")
            out[f"{o}experts.{e}.{ours}"] = w
        out[f"{o}shared.{ours}"] = state.pop(f"{m}shared_experts.{ours}.weight")
    if cfg.moe_latent_size:
        out[o + "latent_down"] = state.pop(m + "fc1_latent_proj.weight")
        out[o + "latent_up"] = state.pop(m + "fc2_latent_proj.weight")
    return out


MODEL = NemotronHModel
