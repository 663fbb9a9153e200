"""DeepSeek-V2 and V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``: also
DeepSeek-V2-Lite, V3/R1, Kimi K2, Moonlight): multi-head latent attention over a latent
KV cache, dense MLPs in the first ``first_k_dense_replace`` layers, experts beside
shared ones in the rest.

**Latent attention** (``LatentAttention``). Per token, ``kv_a_proj`` gives a latent
``c_kv [L]`` (``kv_lora_rank``, RMS-normed) and one rotary key ``k_pe [R]``
(``qk_rope_head_dim``) shared by every head; ``kv_b_proj`` would expand the latent
into each head's key ``k_nope [Dn]`` and value ``v [Dv]``. The cache keeps only
``[c_kv, k_pe]`` per token (one "KV head" of ``L + R``, ``ModelConfig.head_dim``), and
attention runs in the absorbed form (vLLM's and FlashMLA's): ``kv_b_proj``'s key rows
``W_UK [H, Dn, L]`` go into the query, ``q_lat = q_nope @ W_UK`` per head, so that
``q_nope . k_nope = q_lat . c_kv`` and the score is ``[q_lat, q_pe] . [c_kv, k_pe]``:
multi-query attention of all ``H`` heads over that one cached head. Its value is the
cached row itself (the same tensor read as V): the output's first ``L`` columns are the
attention-weighted latent, which ``W_UV [H, Dv, L]`` turns into each head's value
output. Prefill runs the same form (exact; a prompt's keys are never expanded).

The cache's one tensor per layer is ``[blocks, block_size, 1, L + R]`` in the
reference layout, read as both K and V by the torch reference's paged attention
(``kernels.reference``) on every device: the C++ kernel takes heads up to 512 and a
separate V cache, and a real model's latent head is 576 wide. ``kv_bytes_per_token``
counts ``L + R`` per layer, what llama.cpp's MLA cache holds too.

Rotary: DeepSeek rotates the ``R`` dimensions as adjacent pairs (V2's complex rotation,
V3's ``rope_interleave``), which is our layout, so no rows are permuted. YaRN's
``mscale_all_dim`` scales the softmax (``config._deepseek``).

**Experts** (``DeepseekMoe``): V2's softmax routing (``moe.softmax_group_route``), V3's
grouped sigmoid routing with its choice bias (``moe.sigmoid_group_route``), the routed
weights times ``routed_scaling_factor``; the shared experts are one ungated MLP of
``n_shared_experts * moe_intermediate_size`` every token runs, added after the routed.

The layers run the plain torch path in one process (tensor and pipeline parallelism
are refused by name; no CUDA graphs), with the fused CPU ops'
SiLU * up in the non-exact formats, so that block experts run in one native call per
layer (``cpu_moe.cpp``), and the router in another (``cpu_mla.cpp``'s ``group_route``).
In those formats a decode-only step takes ``DeepseekModel._forward_native``: the fused
CPU ops' norms (the residual add inside) and ``cpu_mla.cpp``'s ``store_latent`` and
``decode``, which does the query's rotation, the absorbed query, the paged attention over
the latent rows and the value projection in one call per layer (the torch path's ~20
ops; within float rounding of it). With every matrix in GGUF blocks and the experts
native, that step runs in the native decode loop instead (``model/decode_plan.py``,
``cpu_decode.cpp``'s latent-attention layers): the same kernels in the same order, so
the same bits, without Python between them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels import reference
from structllm.kernels.attention import AttentionMetadata
from structllm.kernels.packed import linear
from structllm.model.config import ModelConfig
from structllm.model.layers import SparseMoe, apply_rope, gated_act
from structllm.model.llama import CHECK_EVERY, refuse_sharding
from structllm.model.moe import (
    GroupPick,
    MoeModel,
    native_group_route,
    sigmoid_group_route,
    softmax_group_route,
)
from structllm.model.sharding import ShardPlan


def _param(dtype: torch.dtype, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class DeepseekMoe(SparseMoe):
    """The routed experts (``SparseMoe``'s) with DeepSeek's router, and the shared
    experts as one ungated MLP (``shared``; no ``shared_gate``)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype, None)
        self.shared_gate = None  # (SparseMoe's Qwen2-MoE gate: DeepSeek has none)
        self.sigmoid = cfg.router_scoring == "sigmoid"
        self.router_bias: Tensor | None = _param(dtype, cfg.num_experts) if self.sigmoid else None
        self.pick = GroupPick.of(cfg)
        self.native_router: Any = None  # cpu_mla.cpp's module (DeepseekModel.use_cpu_ops)

    def route(self, h: Tensor, fused: bool) -> tuple[Tensor, Tensor]:
        """(weights, chosen), ``[T, k]`` each, of ``h: [T, hidden]`` (float32); on the
        fused CPU path (``fused``) by cpu_mla.cpp's ``group_route`` in one call."""
        if fused:
            routed = native_group_route(
                self.native_router, h, self.router, self.router_bias, self.sigmoid, self.pick
            )
            if routed is not None:
                return routed
        if self.router_bias is not None:
            return sigmoid_group_route(h, self.router, self.router_bias, self.pick)
        return softmax_group_route(h, self.router, self.pick)

    def _add_shared(
        self,
        h: Tensor,
        out: Tensor,
        act: str,
        fused_act: Callable[[Tensor], Tensor] | None,
    ) -> Tensor:
        """``out`` (the routed experts' sum) plus the shared experts' MLP of ``h``."""
        if self.shared is None:
            return out
        gate_up = linear(h, self.shared.gate_up_proj, int8_ok=True)  # [T, 2F]
        if fused_act is not None:
            mid = fused_act(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            mid = gated_act(gate, up, act)
        return out + linear(mid, self.shared.down_proj, int8_ok=True)


class LatentAttention(nn.Module):
    """One layer's multi-head latent attention (see the module docstring). Weights:
    ``q_a_proj [Q, hidden]``, ``q_a_norm [Q]``, ``q_b_proj [H*(Dn+R), Q]`` (or, without
    ``q_lora_rank``, ``q_proj [H*(Dn+R), hidden]``); ``kv_a_proj [L+R, hidden]``,
    ``kv_a_norm [L]``; ``k_b [H, Dn, L]``, ``v_b [H, Dv, L]`` (``kv_b_proj``'s key and
    value rows per head); ``o_proj [hidden, H*Dv]``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_heads
        self.num_heads, self.eps, self.scale = nh, cfg.rms_norm_eps, cfg.scale
        self.rank, self.rope_dim = cfg.kv_lora_rank, cfg.rope_dim
        self.nope, self.v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        q_out = nh * (self.nope + self.rope_dim)
        self.q_lora = cfg.q_lora_rank
        if self.q_lora:
            self.q_a_proj = _param(dtype, self.q_lora, h)
            self.q_a_norm = _param(dtype, self.q_lora)
            self.q_b_proj = _param(dtype, q_out, self.q_lora)
            packed: tuple[str, ...] = ("q_a_proj", "q_b_proj")
        else:
            self.q_proj = _param(dtype, q_out, h)
            packed = ("q_proj",)
        self.kv_a_proj = _param(dtype, self.rank + self.rope_dim, h)
        self.kv_a_norm = _param(dtype, self.rank)
        self.k_b = _param(dtype, nh, self.nope, self.rank)
        self.v_b = _param(dtype, nh, self.v_dim, self.rank)
        self.o_proj = _param(dtype, h, nh * self.v_dim)
        self.PACKED = (*packed, "kv_a_proj", "o_proj")

    def queries(self, h: Tensor) -> Tensor:
        """``h: [T, hidden]`` -> the queries ``[T, H, Dn + R]``."""
        if self.q_lora:
            a = F.rms_norm(linear(h, self.q_a_proj), (self.q_lora,), self.q_a_norm, self.eps)
            q = linear(a, self.q_b_proj)
        else:
            q = linear(h, self.q_proj)
        return q.view(h.shape[0], self.num_heads, self.nope + self.rope_dim)

    def forward_native(
        self, h: Tensor, pairs: Tensor, cache: Tensor, meta: AttentionMetadata, ops: Any, mla: Any
    ) -> Tensor:
        """``forward`` of a decode-only step on the CPU kernels: ``h: [T, hidden]``
        (normed) -> ``[T, hidden]``; ``pairs: [T, R/2, 2]`` (cos, sin). cpu_mla.cpp's
        ``store_latent`` writes the step's ``[c_kv, k_pe]`` rows and its ``decode`` runs
        the rotary query, the absorbed query, the attention and each head's value
        projection in one call (the torch path: ~20 ops)."""
        t = h.shape[0]
        if self.q_lora:
            a = ops.rms_norm(linear(h, self.q_a_proj), None, self.q_a_norm, self.eps)
            q = linear(a, self.q_b_proj)
        else:
            q = linear(h, self.q_proj)
        kv = linear(h, self.kv_a_proj)  # [T, L + R]
        mla.store_latent(kv, self.kv_a_norm, self.eps, pairs, cache, meta.slot_mapping)
        q = q.view(t, self.num_heads, self.nope + self.rope_dim)
        tables, lens = meta.block_tables[:t], meta.seq_lens[:t]
        v = mla.decode(q, pairs, self.k_b, self.v_b, cache, tables, lens, self.scale)  # [T, H, Dv]
        return linear(v.view(t, self.num_heads * self.v_dim), self.o_proj)

    def forward(self, h: Tensor, rope: Tensor, cache: Tensor, meta: AttentionMetadata) -> Tensor:
        """``h: [T, hidden]`` (normed) -> ``[T, hidden]``; ``rope: [T, 1, R/2]``; stores
        this step's ``[c_kv, k_pe]`` rows in ``cache: [NB, BS, 1, L + R]``."""
        t, nh, rank = h.shape[0], self.num_heads, self.rank
        q = self.queries(h)
        kv = linear(h, self.kv_a_proj)  # [T, L + R]
        c_kv = F.rms_norm(kv[:, :rank], (rank,), self.kv_a_norm, self.eps)
        k_pe = apply_rope(kv[:, None, rank:], rope)  # [T, 1, R]
        latent = torch.cat([c_kv[:, None], k_pe], dim=-1)  # [T, 1, L + R]
        # absorbed queries: q_lat[t, h] = q_nope[t, h] @ W_UK[h]  ([H, T, Dn] x [H, Dn, L])
        q_lat = torch.bmm(q[..., : self.nope].transpose(0, 1), self.k_b).transpose(0, 1)
        q_pe = apply_rope(q[..., self.nope :], rope)  # [T, H, R]
        o = _attend(torch.cat([q_lat, q_pe], dim=-1), latent, cache, meta, self.scale, rank)
        # each head's value output: o[t, h] @ W_UV[h]^T  ([H, T, L] x [H, L, Dv])
        v = torch.bmm(o.transpose(0, 1), self.v_b.transpose(1, 2))  # [H, T, Dv]
        return linear(v.transpose(0, 1).reshape(t, nh * self.v_dim), self.o_proj)


def _attend(
    q: Tensor, latent: Tensor, cache: Tensor, meta: AttentionMetadata, scale: float, rank: int
) -> Tensor:
    """Store ``latent: [T, 1, L+R]`` at the step's slots, then attend with ``q: [T, H,
    L+R]`` over the cached rows as keys, their first ``L = rank`` columns as values:
    decode rows first (``_latent_decode``), then the prefill chunks (the reference's
    paged prefill, the cache read as both K and V); ``[T, H, L]``."""
    nb, bs, _, d = cache.shape
    cache.view(nb * bs, 1, d).index_copy_(0, meta.slot_mapping, latent.to(cache.dtype))
    nd, t = meta.num_decodes, q.shape[0]
    out = q.new_empty(t, q.shape[1], rank)
    if nd:
        max_len = max(meta.seq_lens_list[:nd])
        tables, lens = meta.block_tables[:nd], meta.seq_lens[:nd]
        out[:nd] = _latent_decode(q[:nd], cache, tables, lens, scale, max_len, rank)
    if nd < t:
        starts = [s - nd for s in meta.query_start_list[nd:]]
        rows = reference.prefill_attention(
            q[nd:],
            cache,
            cache,
            meta.block_tables[nd:],
            starts,
            meta.seq_lens_list[nd:],
            scale,
            latent[nd:],
            latent[nd:],
        )
        out[nd:] = rows[..., :rank]
    return out


def _latent_decode(
    q: Tensor,
    cache: Tensor,
    tables: Tensor,
    lens: Tensor,
    scale: float,
    max_len: int,
    rank: int,
) -> Tensor:
    """One query row per sequence, ``q: [B, H, L+R]`` -> ``[B, H, L]``, over the cache
    ``[NB, BS, 1, L+R]``: the reference's decode (``reference.decode_attention``: whole
    blocks gathered, the slots past each length masked, in float32) with one KV head,
    whose rows are gathered once and serve as keys and, their first ``L`` columns, as
    values (the reference would gather them twice and weigh all ``L+R`` columns)."""
    b, d = q.shape[0], q.shape[2]
    bs = cache.shape[1]
    nblocks = (max_len + bs - 1) // bs
    length = nblocks * bs
    index = tables[:, :nblocks].reshape(-1).to(torch.long)
    rows = cache.index_select(0, index).view(b, length, d).float()  # [B, S, L+R]
    pos = torch.arange(length, device=q.device)
    past_end = pos >= lens[:, None].to(torch.long)  # [B, S]
    bias = torch.zeros(b, 1, length, dtype=torch.float32, device=q.device)
    bias.masked_fill_(past_end[:, None], float("-inf"))
    scores = torch.baddbmm(bias, q.float(), rows.transpose(1, 2), alpha=scale)  # [B, H, S]
    return torch.bmm(scores.softmax(dim=-1), rows[..., :rank]).to(q.dtype)


class DeepseekLayer(nn.Module):
    """Pre-norm latent attention, then pre-norm dense MLP (``gate_up_proj [2F, hidden]``,
    ``down_proj [hidden, F]``) or experts (``moe``)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        h, ffn = cfg.hidden_size, cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = _param(dtype, h)
        self.post_attention_layernorm = _param(dtype, h)
        self.attn = LatentAttention(cfg, dtype)
        self.moe: DeepseekMoe | None = DeepseekMoe(cfg, dtype) if cfg.moe_layer(index) else None
        self.PACKED: tuple[str, ...] = ()
        if self.moe is None:
            self.gate_up_proj = _param(dtype, 2 * ffn, h)
            self.down_proj = _param(dtype, h, ffn)
            self.PACKED = ("gate_up_proj", "down_proj")

    def forward(
        self,
        x: Tensor,
        rope: Tensor,
        cache: Tensor,
        meta: AttentionMetadata,
        fused_act: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """``x: [T, hidden]`` -> ``[T, hidden]``. ``fused_act``: the fused CPU ops'
        SiLU * up of ``[T, 2F]`` rows (the non-exact formats: with it, block experts run
        in one native call, ``SparseMoe.run_experts``), else torch's ops."""
        h = F.rms_norm(x, (x.shape[-1],), self.input_layernorm, self.eps)
        x = x + self.attn(h, rope, cache, meta)
        h = F.rms_norm(x, (x.shape[-1],), self.post_attention_layernorm, self.eps)
        if self.moe is not None:
            return x + self.moe(h, "silu", fused_act)
        gate_up = linear(h, self.gate_up_proj, int8_ok=True)  # [T, 2F]
        if fused_act is not None:
            mid = fused_act(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            mid = gated_act(gate, up, "silu")
        return x + linear(mid, self.down_proj, int8_ok=True)

    def forward_native(
        self,
        x: Tensor,
        delta: Tensor | None,
        pairs: Tensor,
        cache: Tensor,
        meta: AttentionMetadata,
        ops: Any,
        mla: Any,
    ) -> Tensor:
        """``forward`` of a decode-only step on the fused CPU ops, in
        ``DecoderLayer.forward_fused``'s residual bookkeeping: the residual stream ``x:
        [T, hidden]`` takes the last layer's ``delta`` and then the attention's output
        in place; returns the MLP's output, which the next layer (or the final norm)
        adds."""
        h = ops.rms_norm(x, delta, self.input_layernorm, self.eps)  # x += delta first
        a = self.attn.forward_native(h, pairs, cache, meta, ops, mla)
        h = ops.rms_norm(x, a, self.post_attention_layernorm, self.eps)  # x += a
        if self.moe is not None:
            return cast(Tensor, self.moe(h, "silu", ops.silu_mul))
        mid = ops.silu_mul(linear(h, self.gate_up_proj, int8_ok=True))
        return linear(mid, self.down_proj, int8_ok=True)


class DeepseekModel(MoeModel):
    """The DeepSeek-V2/V3 decoder (see the module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        plan: ShardPlan | None = None,
        layers: range | None = None,
    ) -> None:
        why = (
            f"{cfg.architecture} (multi-head latent attention) runs in one process: "
            "tensor and pipeline parallelism are not supported for it"
        )
        refuse_sharding(cfg, plan, layers, why)
        super().__init__(cfg, dtype, plan, layers)
        # the native decode loop (model/decode_plan.py) takes a decode-only step only with
        # cpu_mla.cpp loaded (forward); without it the torch layer loop runs
        self.decode_why = "the Python layer loop (latent attention)"
        self.cuda_graphs = False  # (its attention reads the step's host-side lists)
        self.mla: Any = None  # cpu_mla.cpp's module, with the fused CPU ops (use_cpu_ops)

    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        return DeepseekLayer(cfg, dtype, index)

    def use_cpu_ops(self) -> bool:
        """``LlamaModel.use_cpu_ops``, and with them cpu_mla.cpp's latent-attention
        decode (``mla``), which runs a decode-only step's layers (``_forward_native``)."""
        from structllm.kernels import cpu_ext

        on = super().use_cpu_ops()
        self.mla = cpu_ext.load_mla() if on else None
        for layer in self.layers:
            moe = cast(DeepseekLayer, layer).moe
            if moe is not None:
                moe.native_router = self.mla
        if self.mla is not None:
            self.decode_why = "the Python layer loop on the fused CPU ops (cpu_mla.cpp)"
        return on

    def _native_ok(self, x: Tensor) -> bool:
        """Whether this step's rows and the latent weights suit cpu_mla.cpp: float32 on
        the CPU (a model whose ``k_b``/``v_b`` were kept in another dtype: torch)."""
        attn = cast(DeepseekLayer, self.layers[0]).attn
        return x.dtype == torch.float32 and attn.k_b.dtype == torch.float32

    def _forward_native(
        self,
        x: Tensor,
        pairs: Tensor,
        kv_caches: list[tuple[Tensor, ...]],
        meta: AttentionMetadata,
        between_layers: Callable[[], None] | None,
    ) -> Tensor:
        """A decode-only step's layers on the fused CPU ops and cpu_mla.cpp (see
        ``DeepseekLayer.forward_native``): ``x: [T, hidden]`` -> the final norm's rows;
        ``pairs: [T, R/2, 2]`` (cos, sin)."""
        delta: Tensor | None = None
        ops: Any = self.cpu_ops  # (set: use_cpu_ops loads mla only with them)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if between_layers is not None and i and i % CHECK_EVERY == 0:
                between_layers()
            dl = cast(DeepseekLayer, layer)
            delta = dl.forward_native(x, delta, pairs, cache[0], meta, ops, self.mla)
        return cast(Tensor, ops.rms_norm(x, delta, self.norm, self.cfg.rms_norm_eps))

    def kv_cache_shapes(
        self, layer: int, num_blocks: int, block_size: int
    ) -> tuple[tuple[int, ...], ...]:
        """One tensor per layer: the latent and rotary key rows, ``[NB, BS, 1, L + R]``
        in the reference layout (read as both K and V)."""
        return ((num_blocks, block_size, 1, self.cfg.head_dim),)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, ...]],
        meta: AttentionMetadata,
        between_layers: Callable[[], None] | None = None,
        hidden: Tensor | None = None,
    ) -> Tensor:
        """As ``LlamaModel.forward`` (one process: no ``hidden`` in); each layer's cache
        entry is its one latent tensor."""
        if hidden is not None:
            raise ValueError(f"{self.cfg.architecture} runs without pipeline stages")
        x = self.embed(input_ids)
        half = self.cfg.rope_dim // 2  # the table's pairs past R/2 are the latent's identity
        rope = self.rope_table(int(meta.max_seq_len))[positions, :half].unsqueeze(1)
        if self.mla is not None and meta.num_decodes == x.shape[0] and self._native_ok(x):
            pairs = torch.view_as_real(rope[:, 0])  # [T, R/2, 2] (cos, sin)
            plan = self._native_plan()
            if plan is not None:  # the layers in cpu_decode.cpp: the same kernels, same bits
                delta = plan.run(x, [pairs], kv_caches, meta, between_layers)
                ops: Any = self.cpu_ops
                return cast(Tensor, ops.rms_norm(x, delta, self.norm, self.cfg.rms_norm_eps))
            return self._forward_native(x, pairs, kv_caches, meta, between_layers)
        fused_act = self.cpu_ops.silu_mul if self.cpu_ops is not None else None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if between_layers is not None and i and i % CHECK_EVERY == 0:
                between_layers()
            x = cast(DeepseekLayer, layer)(x, rope, cache[0], meta, fused_act)
        return self.final_norm(x)


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """transformers' DeepSeek names -> ours: ``kv_b_proj [H*(Dn+Dv), L]`` cut per head
    into ``k_b [H, Dn, L]`` and ``v_b [H, Dv, L]``; gate and up fused; experts one by
    one as published (``experts.{e}.gate_proj.weight``) or transformers' in-memory 3-D
    ``experts.gate_up_proj [E, 2F, hidden]``."""
    nh, dn, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    out = {
        "embed_tokens": state.pop("model.embed_tokens.weight"),
        "norm": state.pop("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head"] = state.pop("lm_head.weight")
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        a, oa = p + "self_attn.", o + "attn."
        for ours, theirs in (
            ("q_a_proj", "q_a_proj"),
            ("q_a_norm", "q_a_layernorm"),
            ("q_b_proj", "q_b_proj"),
            ("q_proj", "q_proj"),
            ("kv_a_proj", "kv_a_proj_with_mqa"),
            ("kv_a_norm", "kv_a_layernorm"),
            ("o_proj", "o_proj"),
        ):
            if f"{a}{theirs}.weight" in state:
                out[oa + ours] = state.pop(f"{a}{theirs}.weight")
        kv_b = state.pop(a + "kv_b_proj.weight").view(nh, dn + dv, -1)
        out[oa + "k_b"], out[oa + "v_b"] = kv_b[:, :dn].contiguous(), kv_b[:, dn:].contiguous()
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[o + norm] = state.pop(f"{p}{norm}.weight")
        m = p + "mlp."
        if cfg.moe_layer(i):
            out.update(_experts(state, cfg, m, o + "moe."))
        else:
            gate, up = state.pop(m + "gate_proj.weight"), state.pop(m + "up_proj.weight")
            out[o + "gate_up_proj"] = torch.cat([gate, up])
            out[o + "down_proj"] = state.pop(m + "down_proj.weight")
    return out


def _experts(state: dict[str, Tensor], cfg: ModelConfig, m: str, o: str) -> dict[str, Tensor]:
    """One MoE layer's router, its bias (V3), the routed and the shared experts."""
    out = {o + "router": state.pop(m + "gate.weight")}
    if cfg.router_scoring == "sigmoid":
        out[o + "router_bias"] = state.pop(m + "gate.e_score_correction_bias")
    gate_up, down = (
        state.pop(m + "experts.gate_up_proj", None),
        state.pop(m + "experts.down_proj", None),
    )
    for e in range(cfg.num_experts):
        x = f"{m}experts.{e}."
        if gate_up is None:
            gate, up = state.pop(x + "gate_proj.weight"), state.pop(x + "up_proj.weight")
            out[f"{o}experts.{e}.gate_up_proj"] = torch.cat([gate, up])
        else:
            out[f"{o}experts.{e}.gate_up_proj"] = gate_up[e]
        out[f"{o}experts.{e}.down_proj"] = (
            down[e] if down is not None else state.pop(x + "down_proj.weight")
        )
    if cfg.shared_expert_intermediate_size:
        s = m + "shared_experts."
        gate, up = state.pop(s + "gate_proj.weight"), state.pop(s + "up_proj.weight")
        out[o + "shared.gate_up_proj"] = torch.cat([gate, up])
        out[o + "shared.down_proj"] = state.pop(s + "down_proj.weight")
    return out


MODEL = DeepseekModel
