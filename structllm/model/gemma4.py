"""Gemma 4 (text): Gemma 3's layer (pre- and post-norms, GeGLU, q/k norms per head,
sliding-window and global layers) with

- **layers of two shapes**: the global layers have a head size and KV heads of their
  own (``ModelConfig.head_dim_of``, ``kv_heads_of``), so each layer's KV cache has its
  layer's shape (``kv_layout``); with ``attention_k_eq_v`` their values are their keys'
  projection (before the key norm and rotation);
- values through a weightless RMSNorm, no softmax scale (the q/k norms set it);
- rope per kind of layer: the local layers' plain rope (``rope_local_theta``), the
  global layers' "proportional" one (the first quarter of each head's pairs rotate at
  frequencies over the whole head; ``layers.rope_inv_freq``);
- **KV-shared layers**: the last ``num_kv_shared_layers`` layers compute only queries
  and attend over the cache of the last earlier layer of their kind
  (``ModelConfig.kv_source``); they hold no cache of their own (the runner hands them
  their source's tensors, and the cache is sized for the other layers only). Within a
  step, a prefill chunk's fresh K/V are the source's (``forward`` keeps them);
- **per-layer inputs**: a second embedding table gives each layer a
  ``per_layer_input_size`` slice per token, added to a projection of the embedding
  (``PerLayerInputs``); after its MLP, each layer gates its slice by
  ``gelu(W_gate x)``, projects it back and adds it (normed) to the residual, which is
  then scaled by the layer's ``layer_scalar``;
- **experts beside the MLP** (``enable_moe_block``): a router of its own (a weightless
  norm of the residual, times a learned scale and ``hidden ** -0.5``; softmax, top k,
  renormalised, times a per-expert scale) picks the experts, which run on their own
  norm of the residual; the dense MLP's and the experts' outputs, each normed, are
  added before the MLP's output norm.

Prompt and mixed steps run the plain torch path (of the fused CPU layer ops, where the
format uses them, the GeGLU and the logits' soft-cap); decode-only steps of a model in
GGUF blocks take the native layer loop (``model.decode_plan``: ``add_gemma4_layer``),
the others the same torch path. One
process (tensor and pipeline parallelism are refused by name: layers of two shapes
and layers reading other layers' caches are not cut).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.attention import AttentionImpl, AttentionMetadata, attend, attention
from structllm.kernels.packed import BlockWeight, linear
from structllm.model.config import ModelConfig
from structllm.model.layers import SparseMoe, apply_rope, gated_act, interleave_rope_rows, rope_rows
from structllm.model.llama import CHECK_EVERY, refuse_sharding, text_model_names
from structllm.model.moe import MoeModel
from structllm.model.sharding import ShardPlan


def _param(dtype: torch.dtype, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Gemma4Moe(SparseMoe):
    """Gemma 4's experts and their router (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype, None)
        self.eps = cfg.rms_norm_eps
        self.router_scale = _param(dtype, cfg.hidden_size)
        self.per_expert_scale = _param(dtype, cfg.num_experts)

    def native_act(self, act: str) -> bool:
        return act == "gelu_tanh"  # (cpu_moe.cpp's act 2)

    def native_extras(self) -> dict[str, Any]:
        return {"act": 2}  # GeGLU

    def route_residual(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(weights, chosen), ``[T, k]`` each, from the residual ``x: [T, hidden]``, in
        transformers' order of operations."""
        r = F.rms_norm(x, (x.shape[-1],), None, self.eps) * self.router_scale
        r = r * self.hidden**-0.5
        probs = F.linear(r, self.router).softmax(-1, dtype=torch.float32)  # [T, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[chosen], chosen


class Gemma4Layer(nn.Module):
    """One Gemma 4 layer. ``qkv_proj``'s rows: the queries, then (a layer that caches
    its own K/V) the keys, then (unless its values are its keys) the values."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        nh, nkv, hd = cfg.num_heads, cfg.kv_heads_of(index), cfg.head_dim_of(index)
        ffn = cfg.intermediate_size_of(index)
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.eps, self.window = cfg.rms_norm_eps, cfg.window(index)
        self.local_rope = bool(self.window)
        self.owns_kv = cfg.kv_source(index) == index
        self.k_eq_v = bool(cfg.k_eq_v_layers) and cfg.k_eq_v_layers[index]
        kv_rows = 0 if not self.owns_kv else (1 if self.k_eq_v else 2)
        self.kv_rows = kv_rows

        def p(*shape: int) -> nn.Parameter:
            return _param(dtype, *shape)

        self.input_layernorm, self.attn_out_norm = p(h), p(h)
        self.post_attention_layernorm, self.mlp_out_norm = p(h), p(h)
        self.qkv_proj = p((nh + kv_rows * nkv) * hd, h)
        self.q_norm = p(hd)
        if self.owns_kv:
            self.k_norm = p(hd)
        self.o_proj = p(h, nh * hd)
        self.gate_up_proj, self.down_proj = p(2 * ffn, h), p(h, ffn)
        self.PACKED: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        self.moe: Gemma4Moe | None = Gemma4Moe(cfg, dtype) if cfg.moe_layer(index) else None
        if self.moe is not None:  # the dense MLP's and the experts' own norms
            self.dense_out_norm, self.experts_in_norm, self.experts_out_norm = p(h), p(h), p(h)
        self.per_layer = cfg.per_layer_input_size
        if self.per_layer:
            self.per_layer_gate = p(self.per_layer, h)
            self.per_layer_proj = p(h, self.per_layer)
            self.per_layer_norm = p(h)
            self.PACKED = (*self.PACKED, "per_layer_gate", "per_layer_proj")
        self.layer_scalar = p(1)

    def _norm(self, x: Tensor, w: Tensor | None) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def qkv(self, h: Tensor, rope: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Queries ``[T, H, D]`` and, for a layer caching its own, keys and values
        ``[T, Hkv, D]``: normed, q and k rotated by ``rope: [T, 1, D/2]``."""
        t, nh, nkv, hd = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        rows = linear(h, self.qkv_proj).view(t, nh + self.kv_rows * nkv, hd)
        q = apply_rope(self._norm(rows[:, :nh], self.q_norm), rope)
        if not self.owns_kv:
            return q, None, None
        raw_k = rows[:, nh : nh + nkv]
        k = apply_rope(self._norm(raw_k, self.k_norm), rope)
        v = self._norm(raw_k if self.k_eq_v else rows[:, nh + nkv :], None)
        return q, k, v

    def forward(
        self,
        x: Tensor,
        rope: Tensor,
        caches: tuple[Tensor, Tensor],
        meta: AttentionMetadata,
        impl: AttentionImpl,
        step_kv: dict[int, tuple[Tensor, Tensor]],
        source: int,
        per_layer_input: Tensor | None,
        ops: Any = None,
    ) -> Tensor:
        """``x: [T, hidden]`` -> ``[T, hidden]``. A layer caching its own K/V stores
        them and leaves them in ``step_kv[source]`` (its own index) for the layers
        sharing them; a sharing layer attends over ``caches`` (its source's) with them.
        ``per_layer_input: [T, P]`` or None. ``ops``: the fused CPU ops
        (``LlamaModel.cpu_ops``) where the format runs them, for the GeGLU."""
        t = x.shape[0]
        kc, vc = caches
        q, k, v = self.qkv(self._norm(x, self.input_layernorm), rope)
        if k is not None and v is not None:
            step_kv[source] = (k, v)
            o = attention(impl, q, k, v, kc, vc, meta, 1.0, self.window)
        else:
            k, v = step_kv[source]
            o = attend(impl, q, k, v, kc, vc, meta, 1.0, self.window)
        attn_out = linear(o.reshape(t, -1), self.o_proj)
        x = x + self._norm(attn_out, self.attn_out_norm)
        h = self._norm(x, self.post_attention_layernorm)
        gu = linear(h, self.gate_up_proj, int8_ok=True)  # [T, 2F]: gate | up
        # cpu_layer.cpp's GeGLU on the kernels' pool: torch's gelu and mul_ over [16, 2F]
        # enter an OpenMP region each, which on a loaded VM waits for its second thread
        # (at batch 16, load 20: 44% of a step); it rounds as the fused layer loop does
        if ops is not None:
            act = ops.gelu_tanh_mul(gu)
        else:
            gate, up = gu.chunk(2, dim=-1)
            act = gated_act(gate, up, "gelu_tanh")
        mlp_out = linear(act, self.down_proj, int8_ok=True)
        if self.moe is not None:
            weights, chosen = self.moe.route_residual(x)
            h = self._norm(x, self.experts_in_norm)
            fused = ops.gelu_tanh_mul if ops is not None else None  # (native experts: cpu_moe.cpp)
            experts = self.moe.run_experts(h, weights, chosen, "gelu_tanh", fused)
            mlp_out = self._norm(mlp_out, self.dense_out_norm) + self._norm(
                experts, self.experts_out_norm
            )
        x = x + self._norm(mlp_out, self.mlp_out_norm)
        if per_layer_input is not None:
            g = F.gelu(linear(x, self.per_layer_gate), approximate="tanh") * per_layer_input
            x = x + self._norm(linear(g, self.per_layer_proj), self.per_layer_norm)
        return x * self.layer_scalar


class PerLayerInputs(nn.Module):
    """The per-layer input embeddings: ``embed: [V_p, L * P]`` (looked up, times
    ``sqrt(P)``) plus ``projection: [L * P, hidden]`` of the scaled token embedding
    (times ``hidden ** -0.5``, normed per layer by ``norm: [P]``), times ``2 ** -0.5``."""

    PACKED = ("projection",)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        lp = cfg.num_layers * cfg.per_layer_input_size
        self.layers, self.size, self.eps = (
            cfg.num_layers,
            cfg.per_layer_input_size,
            cfg.rms_norm_eps,
        )
        self.hidden = cfg.hidden_size
        self.embed = _param(dtype, cfg.per_layer_vocab_size, lp)
        self.projection = _param(dtype, lp, cfg.hidden_size)
        self.norm = _param(dtype, cfg.per_layer_input_size)

    def forward(self, input_ids: Tensor, embeds: Tensor) -> Tensor:
        """``input_ids: [T]``, the scaled embeddings ``[T, hidden]`` -> ``[T, L, P]``."""
        t = input_ids.shape[0]
        if isinstance(self.embed, BlockWeight):  # (a GGUF file's table: HalfRows too)
            tokens = self.embed.rows(input_ids) * self.size**0.5  # only these rows dequantised
        else:
            tokens = F.embedding(input_ids, self.embed) * self.size**0.5
        proj = linear(embeds, self.projection) * self.hidden**-0.5
        proj = F.rms_norm(proj.view(t, self.layers, self.size), (self.size,), self.norm, self.eps)
        return (proj + tokens.view(t, self.layers, self.size)) * 2.0**-0.5


class Gemma4Model(MoeModel):
    """The Gemma 4 decoder (see the module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        plan: ShardPlan | None = None,
        layers: range | None = None,
    ) -> None:
        why = (
            "gemma4 runs in one process: tensor and pipeline parallelism are not "
            "supported for it (layers of two shapes, layers reading others' K/V)"
        )
        refuse_sharding(cfg, plan, layers, why)
        super().__init__(cfg, dtype, plan, layers)
        self.per_layer_inputs = PerLayerInputs(cfg, dtype) if cfg.per_layer_input_size else None
        self._rope_global: Tensor | None = None
        self._mm_ids: Tensor | None = None  # [M] multimodal_token_ids, on the model's device

    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        return Gemma4Layer(cfg, dtype, index)

    def kv_layout(self, layer: int) -> tuple[int, int, int]:
        cfg = self.cfg
        return cfg.kv_source(layer), cfg.kv_heads_of(layer), cfg.head_dim_of(layer)

    def rope_tables(self, max_positions: int) -> tuple[Tensor, Tensor]:
        """The global and the local layers' rotations, ``[>= max_positions, D/2]``
        complex64 each at their layers' head size (grown as ``rope_table``)."""
        if self._rope_global is None or self._rope_global.shape[0] < max_positions:
            cfg = self.cfg
            grown = 0 if self._rope_global is None else 2 * self._rope_global.shape[0]
            size = max(max_positions, 256, grown)
            ws = [cfg.head_dim_of(i) for i in range(cfg.num_layers) if not cfg.window(i)]
            ls = [cfg.head_dim_of(i) for i in range(cfg.num_layers) if cfg.window(i)]
            glob = msgspec.structs.replace(cfg, head_dim=ws[0] if ws else cfg.head_dim)
            loc = msgspec.structs.replace(cfg, head_dim=ls[0] if ls else cfg.head_dim)
            self._rope_global = rope_rows(glob, 0, size).to(self.norm.device)
            self._rope_local = rope_rows(loc, 0, size, cfg.rope_local_theta).to(self.norm.device)
        assert self._rope_local is not None
        return self._rope_global, self._rope_local

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, ...]],
        meta: AttentionMetadata,
        between_layers: Callable[[], None] | None = None,
        hidden: Tensor | None = None,
    ) -> Tensor:
        """As ``LlamaModel.forward`` (one process: ``hidden`` is only the embeddings
        with a step's image rows in place, ``engine.image_rows``). A KV-shared layer's
        cache entry is its source layer's tensors. The per-layer inputs project
        ``hidden`` (the image rows too) but look up the pad token where an image token
        is, as transformers does. Images whose tokens see each other both ways
        (``meta.ahead``) do so in the sliding-window layers only: the global layers
        attend causally (transformers' ``create_masks_for_vision_model``)."""
        x = self.embed(input_ids) if hidden is None else hidden
        pli = None
        if self.per_layer_inputs is not None:
            ids = input_ids
            if self.cfg.multimodal_token_ids:
                if self._mm_ids is None or self._mm_ids.device != ids.device:
                    self._mm_ids = torch.tensor(self.cfg.multimodal_token_ids, device=ids.device)
                ids = torch.where(torch.isin(ids, self._mm_ids), self.cfg.pad_token_id, ids)
            pli = self.per_layer_inputs(ids, x)
        glob, loc = self.rope_tables(int(meta.max_seq_len))
        plan = self._decode_plan_for(x, meta)
        if plan is not None:  # (decode rows: the native layer loop, model.decode_plan)
            pairs = [torch.view_as_real(r[positions]) for r in (glob, loc)]  # [T, D/2, 2]
            delta = plan.run(x, pairs, kv_caches, meta, between_layers, per_layer=pli)
            ops: Any = self.cpu_ops  # (not None: _decode_plan_for)
            return cast(Tensor, ops.rms_norm(x, delta, self.norm, self.cfg.rms_norm_eps))
        ropes = glob[positions].unsqueeze(1), loc[positions].unsqueeze(1)  # [T, 1, D/2]
        causal = meta
        if meta.ahead is not None:
            causal = dataclasses.replace(meta, ahead=None, ahead_seqs=frozenset())
        step_kv: dict[int, tuple[Tensor, Tensor]] = {}  # a source layer's fresh K/V
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if between_layers is not None and i and i % CHECK_EVERY == 0:
                between_layers()
            gl = cast(Gemma4Layer, layer)
            kc, vc = cache
            x = gl(
                x,
                ropes[1] if gl.local_rope else ropes[0],
                (kc, vc),
                meta if gl.window else causal,
                self.attn_impl,
                step_kv,
                self.cfg.kv_source(i),
                pli[:, i] if pli is not None else None,
                self.cpu_ops,
            )
        return F.rms_norm(x, (x.shape[-1],), self.norm, self.cfg.rms_norm_eps)

    def _decode_plan_for(self, x: Tensor, meta: AttentionMetadata) -> Any:
        """The native decode loop's plan for this step (``LlamaModel._native_plan``), or
        None: not a decode-only step, a step with adapters or images seeing ahead, or
        not on the fused CPU path."""
        if self.cpu_ops is None or meta.num_decodes != x.shape[0] or meta.ahead is not None:
            return None
        if self.adapters is not None or x.dtype != torch.float32:
            return None
        return self._native_plan()


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """transformers' Gemma 4 names -> ours: q(/k/v) fused, their rotary rows (and norm
    weights) interleaved over the whole head; with values that are the keys'
    projection, ``o_proj``'s columns permuted alike (the values, and so each head's
    output, come out in the keys' interleaved order; the value norm has no weight,
    which a permutation leaves as it is)."""
    state = text_model_names(state)
    state = {
        k: v
        for k, v in state.items()
        if not k.removeprefix("model.").startswith(
            ("embed_vision.", "audio_tower.", "embed_audio.")
        )
    }
    nh = cfg.num_heads
    out = {
        "embed_tokens": state.pop("model.embed_tokens.weight"),
        "norm": state.pop("model.norm.weight"),
    }
    if "lm_head.weight" in state and not cfg.tie_word_embeddings:
        out["lm_head"] = state.pop("lm_head.weight")
    if cfg.per_layer_input_size:
        out["per_layer_inputs.embed"] = state.pop("model.embed_tokens_per_layer.weight")
        out["per_layer_inputs.projection"] = state.pop("model.per_layer_model_projection.weight")
        out["per_layer_inputs.norm"] = state.pop("model.per_layer_projection_norm.weight")
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        nkv = cfg.kv_heads_of(i)
        rot = interleave_rope_rows  # (w, heads): over the whole head (proportional rope)
        parts = [rot(state.pop(a + "q_proj.weight"), nh)]
        out[o + "q_norm"] = rot(state.pop(a + "q_norm.weight"), 1)
        o_proj = state.pop(a + "o_proj.weight")
        if cfg.kv_source(i) == i:
            parts.append(rot(state.pop(a + "k_proj.weight"), nkv))
            out[o + "k_norm"] = rot(state.pop(a + "k_norm.weight"), 1)
            if cfg.k_eq_v_layers and cfg.k_eq_v_layers[i]:
                o_proj = rot(o_proj.T, nh).T.contiguous()
            else:
                parts.append(state.pop(a + "v_proj.weight"))
        out[o + "qkv_proj"] = torch.cat(parts)
        out[o + "o_proj"] = o_proj
        gate, up = state.pop(p + "mlp.gate_proj.weight"), state.pop(p + "mlp.up_proj.weight")
        out[o + "gate_up_proj"] = torch.cat([gate, up])
        out[o + "down_proj"] = state.pop(p + "mlp.down_proj.weight")
        norms = {
            "input_layernorm": "input_layernorm",
            "attn_out_norm": "post_attention_layernorm",
            "post_attention_layernorm": "pre_feedforward_layernorm",
            "mlp_out_norm": "post_feedforward_layernorm",
        }
        if cfg.moe_layer(i):
            norms |= {
                "dense_out_norm": "post_feedforward_layernorm_1",
                "experts_in_norm": "pre_feedforward_layernorm_2",
                "experts_out_norm": "post_feedforward_layernorm_2",
            }
            m = o + "moe."
            out[m + "router"] = state.pop(p + "router.proj.weight")
            out[m + "router_scale"] = state.pop(p + "router.scale")
            out[m + "per_expert_scale"] = state.pop(p + "router.per_expert_scale")
            gate_up, down = (
                state.pop(p + "experts.gate_up_proj"),
                state.pop(p + "experts.down_proj"),
            )
            for e in range(cfg.num_experts):
                out[f"{m}experts.{e}.gate_up_proj"] = gate_up[e]
                out[f"{m}experts.{e}.down_proj"] = down[e]
        if cfg.per_layer_input_size:
            norms["per_layer_norm"] = "post_per_layer_input_norm"
            out[o + "per_layer_gate"] = state.pop(p + "per_layer_input_gate.weight")
            out[o + "per_layer_proj"] = state.pop(p + "per_layer_projection.weight")
        for ours, theirs in norms.items():
            out[o + ours] = state.pop(f"{p}{theirs}.weight")
        out[o + "layer_scalar"] = state.pop(p + "layer_scalar")
    return out


MODEL = Gemma4Model
