"""Gemma 3n (text): Gemma 4's per-layer input embeddings and KV-shared last layers
(``model/gemma4.py``: its cache layout, rope tables and per-layer inputs are reused;
one head size here, plain rope per kind of layer) with

- **AltUp**: the residual is ``S`` streams ``[S, T, hidden]`` (the embedding, and ``S -
  1`` projections of it rescaled to its magnitude); each layer runs on stream 0 only.
  Before it, every stream is predicted as itself plus a token-dependent mix of all
  streams (coefficients from a router, ``tanh`` of a projection of stream 0's norm);
  after it, each stream is corrected by the layer's change to stream 0 times its own
  coefficient plus one. At the end, streams 1.. are projected back, rescaled to
  stream 0's magnitude, and averaged with it;
- **LAuReL**: beside attention, a rank-``laurel_rank`` residual of the normed input
  (normed), added with the attention's output and scaled by ``2 ** -0.5``;
- **sparse MLP activations** in the first layers: the gate's activations below
  ``mean + std * Phi^-1(sparsity)`` of each token's row are cut (a Gaussian top-k);
- the per-layer input, gated by stream 0 (times ``correct_output_scale``), added
  (normed) to streams 1.. only.

Like Gemma 4, it runs the plain torch layer loop in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.attention import AttentionImpl, AttentionMetadata, attend, attention
from structllm.kernels.packed import linear
from structllm.model.config import ModelConfig
from structllm.model.gemma4 import Gemma4Model
from structllm.model.layers import apply_rope, gated_act, interleave_rope_rows
from structllm.model.llama import CHECK_EVERY, text_model_names
from structllm.model.sharding import ShardPlan


def _param(dtype: torch.dtype, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _norm(x: Tensor, w: Tensor | None, eps: float) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _rescaled(x: Tensor, target: Tensor) -> Tensor:
    """``x: [T, hidden]`` scaled to the root-mean-square ``target: [T, 1]``."""
    magnitude = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target / magnitude


class Gemma3nLayer(nn.Module):
    """One Gemma 3n layer over the AltUp streams (see the module docstring);
    ``qkv_proj``'s rows: the queries, then (a layer caching its own K/V) keys, values."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        h, s, r = cfg.hidden_size, cfg.altup_streams, cfg.laurel_rank
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        ffn = cfg.intermediate_size_of(index)
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.eps, self.window, self.hidden = cfg.rms_norm_eps, cfg.window(index), h
        self.local_rope = bool(self.window)
        self.owns_kv = cfg.kv_source(index) == index
        self.sparsity = cfg.activation_sparsity[index] if cfg.activation_sparsity else 0.0

        def p(*shape: int) -> nn.Parameter:
            return _param(dtype, *shape)

        self.input_layernorm, self.attn_out_norm = p(h), p(h)
        self.post_attention_layernorm, self.mlp_out_norm = p(h), p(h)
        self.qkv_proj = p((nh + (2 * nkv if self.owns_kv else 0)) * hd, h)
        self.q_norm = p(hd)
        if self.owns_kv:
            self.k_norm = p(hd)
        self.o_proj = p(h, nh * hd)
        self.gate_up_proj, self.down_proj = p(2 * ffn, h), p(h, ffn)
        self.laurel_left, self.laurel_right, self.laurel_norm = p(r, h), p(h, r), p(h)
        # AltUp: the router [S, hidden] and its norm, the coefficients' maps, the scale
        self.router, self.router_norm = p(s, h), p(h)
        self.prediction_coefs, self.correction_coefs = p(s * s, s), p(s, s)
        self.correct_output_scale = p(h)
        p_size = cfg.per_layer_input_size
        self.per_layer_gate, self.per_layer_proj = p(p_size, h), p(h, p_size)
        self.per_layer_norm = p(h)
        self.PACKED: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        self.PACKED += ("laurel_left", "laurel_right", "per_layer_gate", "per_layer_proj")

    def _modalities(self, x: Tensor) -> Tensor:
        """AltUp's router: ``x: [T, hidden]`` -> ``[T, S]``."""
        routed = F.linear(_norm(x, self.router_norm, self.eps) * self.hidden**-1.0, self.router)
        return torch.tanh(routed.float()).type_as(x)

    def _predict(self, xs: Tensor) -> Tensor:
        """``xs: [S, T, hidden]`` plus each stream's mix of all (``[T, S, S]`` per token)."""
        s, t = xs.shape[0], xs.shape[1]
        coefs = F.linear(self._modalities(xs[0]), self.prediction_coefs).view(t, s, s)
        mixed = torch.matmul(xs.permute(1, 2, 0), coefs.transpose(1, 2))  # [T, hidden, S]
        return mixed.permute(2, 0, 1) + xs

    def _gate(self, gate: Tensor) -> Tensor:
        """The sparse layers' gate ``[T, F]``: what lies below each row's cutoff cut."""
        if not self.sparsity:
            return gate
        level = torch.tensor(self.sparsity, dtype=torch.float32, device=gate.device)
        multiplier = torch.distributions.normal.Normal(0, 1).icdf(level).type(gate.dtype)
        mean = gate.mean(dim=-1, keepdim=True)
        std = gate.std(dim=-1, keepdim=True, unbiased=False)
        return F.relu(gate - (mean + std * multiplier))

    def _attend(
        self,
        h: Tensor,
        rope: Tensor,
        caches: tuple[Tensor, Tensor],
        meta: AttentionMetadata,
        impl: AttentionImpl,
        step_kv: dict[int, tuple[Tensor, Tensor]],
        source: int,
    ) -> Tensor:
        """Attention on the normed stream ``h: [T, hidden]`` -> ``[T, hidden]``, as
        ``Gemma4Layer``'s (a caching layer leaves its K/V in ``step_kv[source]``)."""
        t, nh, nkv, hd = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        rows = linear(h, self.qkv_proj).view(t, -1, hd)
        q = apply_rope(_norm(rows[:, :nh], self.q_norm, self.eps), rope)
        kc, vc = caches
        if self.owns_kv:
            k = apply_rope(_norm(rows[:, nh : nh + nkv], self.k_norm, self.eps), rope)
            v = _norm(rows[:, nh + nkv :], None, self.eps)
            step_kv[source] = (k, v)
            o = attention(impl, q, k, v, kc, vc, meta, 1.0, self.window)
        else:
            k, v = step_kv[source]
            o = attend(impl, q, k, v, kc, vc, meta, 1.0, self.window)
        return linear(o.reshape(t, -1), self.o_proj)

    def forward(
        self,
        xs: Tensor,
        rope: Tensor,
        caches: tuple[Tensor, Tensor],
        meta: AttentionMetadata,
        impl: AttentionImpl,
        step_kv: dict[int, tuple[Tensor, Tensor]],
        source: int,
        per_layer_input: Tensor,
    ) -> Tensor:
        """``xs: [S, T, hidden]`` -> ``[S, T, hidden]``; ``per_layer_input: [T, P]``."""
        predictions = self._predict(xs)
        active = predictions[0]
        normed = _norm(active, self.input_layernorm, self.eps)
        laurel = linear(linear(normed, self.laurel_left), self.laurel_right)
        laurel = normed + _norm(laurel, self.laurel_norm, self.eps)
        attn = self._attend(normed, rope, caches, meta, impl, step_kv, source)
        x = (active + _norm(attn, self.attn_out_norm, self.eps) + laurel) * 2.0**-0.5
        h = _norm(x, self.post_attention_layernorm, self.eps)
        gate, up = linear(h, self.gate_up_proj).chunk(2, dim=-1)
        mlp = linear(gated_act(self._gate(gate), up, "gelu_tanh"), self.down_proj)
        x = x + _norm(mlp, self.mlp_out_norm, self.eps)
        # AltUp's correction: each stream gets the change to stream 0 times (1 + its coef)
        coefs = F.linear(self._modalities(x), self.correction_coefs) + 1.0  # [T, S]
        corrected = (x - active).unsqueeze(0) * coefs.T.unsqueeze(-1) + predictions
        first = corrected[0] * self.correct_output_scale
        g = F.gelu(linear(first, self.per_layer_gate), approximate="tanh") * per_layer_input
        extra = _norm(linear(g, self.per_layer_proj), self.per_layer_norm, self.eps)
        return torch.cat([corrected[:1], corrected[1:] + extra])


class Gemma3nModel(Gemma4Model):
    """The Gemma 3n decoder (see the module docstring): Gemma 4's cache layout, rope
    tables and per-layer inputs; AltUp's projections into and out of the streams,
    ``altup_in``/``altup_out: [S - 1, hidden, hidden]``."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        plan: ShardPlan | None = None,
        layers: range | None = None,
    ) -> None:
        super().__init__(cfg, dtype, plan, layers)
        h, s = cfg.hidden_size, cfg.altup_streams
        self.altup_in = _param(dtype, s - 1, h, h)
        self.altup_out = _param(dtype, s - 1, h, h)
        self.native_decode = False  # (Gemma 4's native layer is not its layer)
        self.decode_why = "the Python layer loop (Gemma 3n)"

    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        return Gemma3nLayer(cfg, dtype, index)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, ...]],
        meta: AttentionMetadata,
        between_layers: Callable[[], None] | None = None,
        hidden: Tensor | None = None,
    ) -> Tensor:
        """As ``Gemma4Model.forward``, over the AltUp streams."""
        if hidden is not None:
            raise ValueError("gemma3n runs without pipeline stages")
        x = self.embed(input_ids)
        assert self.per_layer_inputs is not None
        in_table = input_ids < self.cfg.per_layer_vocab_size  # (others: row 0, as theirs)
        pli = self.per_layer_inputs(torch.where(in_table, input_ids, 0), x)
        target = torch.mean(x**2, dim=-1, keepdim=True) ** 0.5
        xs = torch.stack([x, *(_rescaled(F.linear(x, w), target) for w in self.altup_in)])
        glob, loc = self.rope_tables(int(meta.max_seq_len))
        ropes = glob[positions].unsqueeze(1), loc[positions].unsqueeze(1)  # [T, 1, D/2]
        step_kv: dict[int, tuple[Tensor, Tensor]] = {}
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if between_layers is not None and i and i % CHECK_EVERY == 0:
                between_layers()
            gl = cast(Gemma3nLayer, layer)
            kc, vc = cache
            rope = ropes[1] if gl.local_rope else ropes[0]
            xs = gl(
                xs, rope, (kc, vc), meta, self.attn_impl, step_kv, self.cfg.kv_source(i), pli[:, i]
            )
        target = torch.mean(xs[0] ** 2, dim=-1, keepdim=True) ** 0.5
        outs = [
            _rescaled(F.linear(x, w), target) for x, w in zip(xs[1:], self.altup_out, strict=True)
        ]
        x = torch.stack([xs[0], *outs]).mean(dim=0)
        return F.rms_norm(x, (x.shape[-1],), self.norm, self.cfg.rms_norm_eps)


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """transformers' Gemma 3n names -> ours: q/k/v fused, their rotary rows (and norm
    weights) interleaved over the whole head; AltUp's projections stacked."""
    state = text_model_names(state)
    state = {
        k: v
        for k, v in state.items()
        if not k.removeprefix("model.").startswith(
            ("embed_vision.", "audio_tower.", "embed_audio.")
        )
    }
    nh, nkv, s = cfg.num_heads, cfg.num_kv_heads, cfg.altup_streams
    out = {
        "embed_tokens": state.pop("model.embed_tokens.weight"),
        "norm": state.pop("model.norm.weight"),
        "per_layer_inputs.embed": state.pop("model.embed_tokens_per_layer.weight"),
        "per_layer_inputs.projection": state.pop("model.per_layer_model_projection.weight"),
        "per_layer_inputs.norm": state.pop("model.per_layer_projection_norm.weight"),
    }
    for ours, theirs in (
        ("altup_in", "altup_projections"),
        ("altup_out", "altup_unembed_projections"),
    ):
        out[ours] = torch.stack([state.pop(f"model.{theirs}.{i}.weight") for i in range(s - 1)])
    if "lm_head.weight" in state and not cfg.tie_word_embeddings:
        out["lm_head"] = state.pop("lm_head.weight")
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        parts = [interleave_rope_rows(state.pop(a + "q_proj.weight"), nh)]
        out[o + "q_norm"] = interleave_rope_rows(state.pop(a + "q_norm.weight"), 1)
        if cfg.kv_source(i) == i:
            parts.append(interleave_rope_rows(state.pop(a + "k_proj.weight"), nkv))
            parts.append(state.pop(a + "v_proj.weight"))
            out[o + "k_norm"] = interleave_rope_rows(state.pop(a + "k_norm.weight"), 1)
        out[o + "qkv_proj"] = torch.cat(parts)
        out[o + "o_proj"] = state.pop(a + "o_proj.weight")
        gate, up = state.pop(p + "mlp.gate_proj.weight"), state.pop(p + "mlp.up_proj.weight")
        out[o + "gate_up_proj"] = torch.cat([gate, up])
        out[o + "down_proj"] = state.pop(p + "mlp.down_proj.weight")
        names = {
            "input_layernorm": "input_layernorm.weight",
            "attn_out_norm": "post_attention_layernorm.weight",
            "post_attention_layernorm": "pre_feedforward_layernorm.weight",
            "mlp_out_norm": "post_feedforward_layernorm.weight",
            "laurel_left": "laurel.linear_left.weight",
            "laurel_right": "laurel.linear_right.weight",
            "laurel_norm": "laurel.post_laurel_norm.weight",
            "router": "altup.modality_router.weight",
            "router_norm": "altup.router_norm.weight",
            "prediction_coefs": "altup.prediction_coefs.weight",
            "correction_coefs": "altup.correction_coefs.weight",
            "correct_output_scale": "altup.correct_output_scale",
            "per_layer_gate": "per_layer_input_gate.weight",
            "per_layer_proj": "per_layer_projection.weight",
            "per_layer_norm": "post_per_layer_input_norm.weight",
        }
        for ours, theirs in names.items():
            out[o + ours] = state.pop(p + theirs)
    return out


MODEL = Gemma3nModel
