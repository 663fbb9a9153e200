"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

The forward pass takes one flat batch of ``T`` tokens from many sequences (prefill
chunks and decode tokens mixed, see ``kernels.attention``) and returns hidden states
``[T, hidden]``; logits are computed only for the rows that will be sampled.

Two layout choices cut the number of ops per layer, which dominates single-stream
latency on a CPU:
- q/k/v are one matmul (``qkv_proj``) and gate/up another (``gate_up_proj``).
- Rotary pairs are interleaved within each q/k head (``(x0, x1), (x2, x3), ...``, the
  GGUF layout), so rotation is one complex multiply. Hugging Face checkpoints store the
  pairs as halves (``x_i`` with ``x_{i+D/2}``); the loader permutes their q/k rows.
  Attention scores are unchanged, since q and k are permuted alike and v is not.

Tensor parallelism (``sharding`` says who holds what): a model built with a
``ShardPlan`` holds one rank's slices, and once ``tp`` is set its forward pass adds the
collectives: an all-reduce after each row-parallel matmul and after the masked
embedding lookup, and a gather of the vocabulary slices of the logits to rank 0. With
no plan (one process) the forward pass is the plain one, without a single extra op.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.attention import (
    AttentionImpl,
    AttentionMetadata,
    CpuAttention,
    TorchAttention,
    attend,
    attention,
)
from structllm.kernels.packed import BlockWeight, HalfWeight, Weight, half_matrix, linear
from structllm.model.collectives import TensorParallelGroup
from structllm.model.config import ModelConfig
from structllm.model.deepstack import Deepstack
from structllm.model.layers import (
    SparseMoe,
    apply_rope,
    gated_act,
    interleave_rope_rows,
    mrope_rotations,
    rope_rows,
    soft_cap,
)
from structllm.model.lora import LoraRows
from structllm.model.sharding import ShardPlan

# Layers between two calls of forward's ``between_layers`` (the engine's check for
# aborts that make the running step pointless): a step is cut short at most this many
# layers after the check would say so. ``LlamaModel.check_every`` is the Python layer
# loop's, which the engine lowers to 1 for a step an urgent arrival may cut
# (``EngineCore._check_every``).
CHECK_EVERY = 4

log = logging.getLogger(__name__)


def onednn_linear_available() -> bool:
    """Whether this torch build can pack weights for oneDNN's CPU matmul."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4))
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4), w, None, "none", [], "")
        return bool(torch.allclose(y, torch.full((2, 4), 4.0)))
    except (AttributeError, RuntimeError):
        return False


class DecoderLayer(nn.Module):
    LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    # The output projection may take 8-bit activations (``packed.linear``'s int8_ok),
    # as the MLP's matmuls do; the q/k/v projection keeps 16 bits. On the default
    # model's requantised files (bench/accuracy.py --windows 2, KL from the file's float
    # model / top-1; llama.cpp's, which rounds every matmul's activations to 8 bits, in
    # brackets): o_proj in 8 bits, Q4_K_M 8.7e-4 / 97.25% [3.8e-3 / 96.86%], Q5_K_M 1.0e-3
    # / 98.82% [4.6e-3 / 97.25%], Q4_0 1.3e-3 / 98.04% [3.3e-3 / 95.49%]; q/k/v in 8 bits
    # as well doubled the KL and took Q5_K_M's top-1 to 96.86%, under issue 46's bar
    # (llama.cpp's minus 0.3 points).
    O_INT8 = True

    """One layer, or one rank's slice of it: its query heads and their KV heads, and its
    columns of the MLP (see ``sharding``). The family options of ``ModelConfig`` decide
    which norms it has (pre-norms, output norms, q/k norms), its MLP's activation, its
    attention window, scale and soft-cap, and whether it rotates q and k.

    Norm weights, by our names: ``input_layernorm`` before attention,
    ``post_attention_layernorm`` before the MLP (Llama's names), ``attn_out_norm`` and
    ``mlp_out_norm`` on the attention and MLP outputs, ``q_norm``/``k_norm`` on q and k
    before rotation (``[D]`` per head, or over the whole projection with ``qk_norm ==
    "full"``; their entries permuted like the q/k rows)."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None = None, index: int = 0
    ) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        nh = plan.num_heads if plan else cfg.num_heads
        nkv = plan.num_kv_heads if plan else cfg.num_kv_heads
        ffn = len(plan.ffn) if plan else cfg.intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.eps = cfg.rms_norm_eps
        self.window = cfg.window(index)
        self.chunk = cfg.chunk(index)  # chunked local attention (Llama 4's; 0: none)
        self.rotates = cfg.rotates(index)
        self.local_rope = bool(self.window) and cfg.rope_local_theta is not None
        self.scale, self.softcap = cfg.scale, cfg.attn_softcap
        self.qk_norm, self.act, self.residual_scale = cfg.qk_norm, cfg.mlp_act, cfg.residual_scale
        self.pre_norms, self.post_norms = cfg.pre_norms, cfg.post_norms
        # q/k norms over the whole projection, sharded: its widths over all ranks, each
        # KV head counted once per rank holding a copy (replicated KV heads, sharding)
        share = (
            plan.world_size // cfg.num_kv_heads
            if plan and plan.world_size > cfg.num_kv_heads
            else 1
        )
        self.qk_widths = (cfg.num_heads * hd, cfg.num_kv_heads * hd * share)
        qkv_out = (nh + 2 * nkv) * hd

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_layernorm = p(h) if cfg.pre_norms else None
        self.qkv_proj = p(qkv_out, h)
        self.qkv_bias = p(qkv_out) if cfg.qkv_bias else None
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = p(hd), p(hd)
        elif cfg.qk_norm in ("full", "layer_heads"):
            self.q_norm, self.k_norm = p(nh * hd), p(nkv * hd)
        self.o_proj = p(h, nh * hd)
        # o_proj's bias (added once, after the all-reduce: the classic layouts', gpt-oss's
        # from model.gpt_oss) and gpt-oss's [H] attention sinks (see AttentionImpl)
        self.o_bias: Tensor | None = p(h) if cfg.o_bias else None
        self.sinks: Tensor | None = None
        # Qwen3.5's gated attention: the output times sigmoid(h @ attn_gate^T), per row
        self.attn_gate = p(nh * hd, h) if cfg.attn_output_gate else None
        self.attn_out_norm = p(h) if cfg.post_norms else None
        self.post_attention_layernorm = p(h) if cfg.pre_norms else None
        self.moe = self.make_moe(cfg, dtype, plan) if cfg.moe_layer(index) else None
        if self.moe is None:
            self.gate_up_proj = p(2 * ffn, h)
            self.down_proj = p(h, ffn)
        self.PACKED = ("qkv_proj", "o_proj") if self.moe else self.LINEARS
        if self.attn_gate is not None:
            self.PACKED = (*self.PACKED, "attn_gate")
        self.mlp_out_norm = p(h) if cfg.post_norms else None
        # forward_fused's norm weights, read once (nn.Module.__getattr__ costs ~0.5 us a
        # parameter, 4 a layer a step); LlamaModel.assign_weights resets it
        self._norms: tuple[Tensor | None, ...] | None = None
        self._plain_out = self.residual_scale == 1.0
        # the step's LoRA rows while a step has any (model.lora.active), else None
        self.adapters: LoraRows | None = None
        self.layer_no = index
        # scales this step's queries in place, given ``qkv: [T, H + 2 Hkv, D]`` after the
        # q/k norms, before rotation (Llama 4's attention temperature); None: none
        self.scale_queries: Callable[[Tensor], None] | None = None

    def make_moe(self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None) -> SparseMoe:
        """The layer's mixture of experts (a family's own kind: ``model.gpt_oss``)."""
        return SparseMoe(cfg, dtype, plan)

    def _norm(self, x: Tensor, w: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _norm_qk(self, qkv: Tensor, tp: TensorParallelGroup | None = None) -> Tensor:
        """q and k of ``qkv: [T, H + 2 Hkv, D]`` through their norms (in place). Over the
        whole projection with ``tp``: this rank's slice, by the mean square of the whole
        (its sums of squares all-reduced, ``[T, 2]``)."""
        t, nh, nkv = qkv.shape[0], self.num_heads, self.num_kv_heads
        q, k = qkv[:, :nh], qkv[:, nh : nh + nkv]
        if self.qk_norm == "head":
            q.copy_(self._norm(q, self.q_norm))
            k.copy_(self._norm(k, self.k_norm))
        elif self.qk_norm == "layer_heads":  # LayerNorm per head, [H * D] weights
            q.copy_(F.layer_norm(q, (q.shape[-1],), eps=self.eps) * self.q_norm.view(nh, -1))
            k.copy_(F.layer_norm(k, (k.shape[-1],), eps=self.eps) * self.k_norm.view(nkv, -1))
        elif tp is None:  # over the whole projection
            q.copy_(self._norm(q.reshape(t, -1), self.q_norm).view_as(q))
            k.copy_(self._norm(k.reshape(t, -1), self.k_norm).view_as(k))
        else:
            qf, kf = q.reshape(t, -1).float(), k.reshape(t, -1).float()
            squares = torch.stack([qf.square().sum(-1), kf.square().sum(-1)], dim=1)  # [T, 2]
            tp.all_reduce(squares)
            widths = torch.tensor(self.qk_widths, dtype=torch.float32, device=qkv.device)
            inv = torch.rsqrt(squares / widths + self.eps)  # [T, 2]
            q.copy_((qf * inv[:, :1] * self.q_norm.float()).view_as(q))
            k.copy_((kf * inv[:, 1:] * self.k_norm.float()).view_as(k))
        return qkv

    def _residual_out(self, out: Tensor, norm: Tensor | None) -> Tensor:
        """A sublayer's output as added to the residual stream: output norm, multiplier."""
        if norm is not None:
            out = self._norm(out, norm)
        if self.residual_scale != 1.0:
            out = out * self.residual_scale
        return out

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
        """``x: [T, hidden]`` -> ``[T, hidden]``; ``rope: [T, 1, D/2]`` complex64 or None
        (a layer without rotary embedding). With ``tp``, ``o_proj`` and ``down_proj``
        each yield this rank's partial sum, completed by an all-reduce."""
        return self.feed_forward(self.attend(x, rope, k_cache, v_cache, meta, impl, tp), tp)

    def attend(
        self,
        x: Tensor,
        rope: Tensor | None,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        impl: AttentionImpl,
        tp: TensorParallelGroup | None = None,
    ) -> Tensor:
        """The attention half of ``forward``: ``x`` plus its attention output."""
        h = self._norm(x, self.input_layernorm) if self.input_layernorm is not None else x
        attn_out = self.self_attention(h, rope, k_cache, v_cache, meta, impl, tp)
        return x + self._residual_out(attn_out, self.attn_out_norm)

    def self_attention(
        self,
        h: Tensor,
        rope: Tensor | None,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        impl: AttentionImpl,
        tp: TensorParallelGroup | None = None,
    ) -> Tensor:
        """The attention of the normed input ``h [T, hidden]`` -> ``[T, hidden]`` (whole,
        all-reduced with ``tp``, its output bias added)."""
        t = h.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(h, self.qkv_proj, self.qkv_bias)
        if self.adapters is not None:
            self.adapters.add(self.layer_no, "qkv", h, qkv)
        qkv = qkv.view(t, nh + 2 * nkv, hd)
        if self.qk_norm != "none":
            qkv = self._norm_qk(qkv, tp)
        if self.scale_queries is not None:
            self.scale_queries(qkv)
        qk = qkv[:, : nh + nkv] if rope is None else apply_rope(qkv[:, : nh + nkv], rope)
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, nh + nkv :]
        o = attention(
            impl,
            q,
            k,
            v,
            k_cache,
            v_cache,
            meta,
            self.scale,
            self.window,
            self.softcap,
            self.sinks,
            self.chunk,
        )  # [T, nh, D]
        o = o.reshape(t, nh * hd)
        if self.attn_gate is not None:
            o = o * torch.sigmoid(linear(h, self.attn_gate))
        attn_out = linear(o, self.o_proj, self.o_bias if tp is None else None, self.O_INT8)
        if self.adapters is not None:
            self.adapters.add(self.layer_no, "o", o, attn_out)
        if tp is not None:  # each rank's partial sum: the bias once, after the sum
            tp.all_reduce(attn_out)
            if self.o_bias is not None:
                attn_out.add_(self.o_bias)
        return attn_out

    def feed_forward(self, x: Tensor, tp: TensorParallelGroup | None = None) -> Tensor:
        """The MLP half of ``forward``: ``x`` plus its MLP (or experts') output."""
        h = (
            self._norm(x, self.post_attention_layernorm)
            if self.post_attention_layernorm is not None
            else x
        )
        # the MLP's matmuls may run 8-bit activations (packed.INT8_MIN_M), the rest not
        if self.moe is not None:
            mlp_out = self.moe(h, self.act)
        else:
            gate_up = linear(h, self.gate_up_proj, int8_ok=True)
            if self.adapters is not None:
                self.adapters.add(self.layer_no, "gate_up", h, gate_up)
            gate, up = gate_up.chunk(2, dim=-1)
            mid = gated_act(gate, up, self.act)
            mlp_out = linear(mid, self.down_proj, int8_ok=True)
            if self.adapters is not None:
                self.adapters.add(self.layer_no, "down", mid, mlp_out)
        if tp is not None:
            tp.all_reduce(mlp_out)
        return x + self._residual_out(mlp_out, self.mlp_out_norm)

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
        """``forward`` through the fused CPU ops (``cpu_layer.cpp``), same contract but
        for the residual: ``x: [T, hidden]`` is the residual stream before the previous
        layer's output ``delta`` (None for the first layer) was added; both additions
        happen in place in ``x``, and this layer's output is returned as the next delta.
        ``rope: [T, D/2, 2]`` float32 (cos, sin); a layer without rotary embedding gets
        cos 1, sin 0 (the store still runs). ``o_out``: a ``[T, H * D]`` buffer for the
        attention output of a decode-only step (each layer's is read by its ``o_proj``
        before the next layer writes it), or None."""
        attn_out = self.fused_attend(x, delta, rope, k_cache, v_cache, meta, impl, tp, ops, o_out)
        norms = self._norms  # (set by fused_attend)
        assert norms is not None
        post_norm, mlp_out_norm = norms[1], norms[3]
        plain = tp is None and self._plain_out  # nothing between a sublayer and the residual
        h = self._fused_norm(ops, x, attn_out, post_norm)
        fused_act = ops.gelu_tanh_mul if self.act == "gelu_tanh" else ops.silu_mul
        if self.moe is not None:
            mlp_out = self.moe(h, self.act, fused_act)
        else:
            gate_up = linear(h, self.gate_up_proj, int8_ok=True)  # int8 allowed: see forward
            if self.adapters is not None:
                self.adapters.add(self.layer_no, "gate_up", h, gate_up)
            mid = fused_act(gate_up)
            mlp_out = linear(mid, self.down_proj, int8_ok=True)
            if self.adapters is not None:
                self.adapters.add(self.layer_no, "down", mid, mlp_out)
        if not plain or mlp_out_norm is not None:
            mlp_out = self._fused_out(ops, mlp_out, tp, mlp_out_norm)
        return mlp_out

    def fused_attend(
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
        """``forward_fused``'s first half: ``x += delta``, the pre-norm, attention and
        ``o_proj`` -> the attention's output ``[T, hidden]`` as added to the residual
        (after its output norm and multiplier), not yet added (a block without an MLP,
        Nemotron-H's, returns it as the next delta)."""
        t = x.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qk_norm == "layer_heads":  # (classic.py's, which declines the fused ops)
            raise NotImplementedError("the classic layouts run on the plain path only")
        norms = self._norms
        if norms is None:
            norms = self._norms = (
                self.input_layernorm,
                self.post_attention_layernorm,
                self.attn_out_norm,
                self.mlp_out_norm,
            )
        in_norm, _, attn_out_norm, _ = norms
        h = self._fused_norm(ops, x, delta, in_norm)
        qkv = linear(h, self.qkv_proj, self.qkv_bias)
        if self.adapters is not None:
            self.adapters.add(self.layer_no, "qkv", h, qkv)
        qkv = qkv.view(t, nh + 2 * nkv, hd)
        if self.qk_norm == "full" and tp is not None:  # over all ranks' slices
            self._norm_qk(qkv, tp)
        elif self.qk_norm != "none":  # per head, or over the whole projection (OLMo 2)
            ops.head_rms_norm(qkv, nh, nkv, self.q_norm, self.k_norm, self.eps)
        if self.scale_queries is not None:
            self.scale_queries(qkv)
        ops.rope_store(qkv, rope, nh, nkv, k_cache, v_cache, meta.slot_mapping)
        window, cap = self.window, self.softcap
        if meta.num_decodes == t:  # decode only: queries read from qkv, [T, nh * D] out
            o = cast(CpuAttention, impl).decode_rows(
                qkv,
                nh,
                k_cache,
                v_cache,
                meta,
                self.scale,
                window,
                cap,
                o_out,
                self.sinks,
                self.chunk,
            )
        else:
            q, k, v = qkv[:, :nh], qkv[:, nh : nh + nkv], qkv[:, nh + nkv :]
            o = attend(
                impl,
                q,
                k,
                v,
                k_cache,
                v_cache,
                meta,
                self.scale,
                window,
                cap,
                self.sinks,
                self.chunk,
            )
            o = o.reshape(t, nh * hd)
        if self.attn_gate is not None:  # Qwen3.5's gated attention (h: a new tensor)
            o = o * torch.sigmoid(linear(h, self.attn_gate))
        attn_out = linear(o, self.o_proj, self.o_bias, self.O_INT8)
        if self.adapters is not None:
            self.adapters.add(self.layer_no, "o", o, attn_out)
        plain = tp is None and self._plain_out  # nothing between a sublayer and the residual
        if not plain or attn_out_norm is not None:
            attn_out = self._fused_out(ops, attn_out, tp, attn_out_norm)
        return attn_out

    def _fused_norm(self, ops: Any, x: Tensor, delta: Tensor | None, w: Tensor | None) -> Tensor:
        """``x += delta``, then the pre-norm (or ``x`` itself, without one)."""
        if w is not None:
            return cast(Tensor, ops.rms_norm(x, delta, w, self.eps))
        if delta is not None:
            x.add_(delta)
        return x

    def _fused_out(
        self, ops: Any, out: Tensor, tp: TensorParallelGroup | None, norm: Tensor | None
    ) -> Tensor:
        if tp is not None:
            tp.all_reduce(out)
        if norm is not None:
            out = ops.rms_norm(out, None, norm, self.eps)
        if self.residual_scale != 1.0:
            out.mul_(self.residual_scale)
        return out


def refuse_sharding(
    cfg: ModelConfig, plan: ShardPlan | None, layers: range | None, why: str
) -> None:
    """``ValueError(why)`` when a model that runs in one process is given a tensor-parallel
    ``plan`` or a pipeline stage's ``layers`` (anything but all of them)."""
    if plan is not None or (layers is not None and layers != range(cfg.num_layers)):
        raise ValueError(why)


class RowGather:
    """Gathers of a few rows of host tables by numpy into buffers kept per (table, row
    count). A decode step runs cold (the weights just streamed through the caches), and
    a torch index and ``view_as_real`` cost it ~60 us of thread CPU time on the default
    model where numpy's ``take`` into a kept buffer costs ~25 (bench/step_overhead.py,
    loaded 2-vCPU machine). The tables are read through numpy views of the same memory,
    made once per table; a buffer is rewritten by the next gather of its key and row
    count, so its rows are valid for one step."""

    MAX_ROWS = 8  # decode steps; longer steps index with torch

    def __init__(self) -> None:
        self._tables: dict[str, tuple[Tensor, np.ndarray, torch.dtype]] = {}
        self._out: dict[tuple[str, int], tuple[Tensor, np.ndarray]] = {}

    def rows(self, key: str, table: Tensor, index: Tensor) -> Tensor:
        """``table[index]`` (``table`` ``[S, ...]`` contiguous on the host, a complex one
        as its float pairs; ``index`` ``[T]`` int64), in ``key``'s buffer for ``T`` rows."""
        held = self._tables.get(key)
        if held is None or held[0] is not table:
            real = torch.view_as_real(table) if table.is_complex() else table
            held = self._tables[key] = (table, real.numpy(), real.dtype)
            self._out = {k: v for k, v in self._out.items() if k[0] != key}
        t = index.shape[0]
        out = self._out.get((key, t))
        if out is None:  # (a torch allocation: aligned as the index op's output)
            buf = torch.empty((t, *held[1].shape[1:]), dtype=held[2])
            out = self._out[(key, t)] = (buf, buf.numpy())
        np.take(held[1], index.numpy(), axis=0, out=out[1])
        return out[0]


class LlamaModel(nn.Module):
    """Weights and forward pass. Parameters are created empty; the loader fills them.
    With ``plan``, the model is that rank's shard, and ``tp`` must be set before use."""

    # an F16/BF16 GGUF file's float16 matrices as ``HalfMatrix`` (the block kernels'
    # float16 rows, which the native decode loop runs: a decode step's matmuls read from
    # memory) rather than fbgemm's ``HalfWeight`` (see pack_weights)
    FILE_HALF_ROWS = True

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        plan: ShardPlan | None = None,
        layers: range | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.plan = plan
        # the decoder layers held here: all, or a pipeline stage's (``model.stages``);
        # ``self.layers[i]`` is the model's layer ``layer_range[i]``
        self.layer_range = layers if layers is not None else range(cfg.num_layers)
        self.tp: TensorParallelGroup | None = None
        vocab = len(plan.vocab) if plan else cfg.vocab_size
        self.embed_tokens = nn.Parameter(
            torch.empty(vocab, cfg.hidden_size, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(self.make_layer(cfg, dtype, plan, i) for i in self.layer_range)
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(vocab, cfg.hidden_size, dtype=dtype), requires_grad=False)
        )
        self.attn_impl: AttentionImpl = TorchAttention()
        self._rope_cache: Tensor | None = None
        self._rope_local: Tensor | None = None  # the windowed layers' (rope_local_theta)
        # the fused path's rotary pairs of a decode step, gathered by numpy into buffers
        # kept per row count: see RowGather
        self._gather = RowGather()
        self._packed_head: Weight | None = None
        self.lm_head_bias: Tensor | None = None  # (a classic layout's, model/classic.py)
        self.cpu_ops: Any | None = None  # the fused layer ops, see use_cpu_ops
        # every layer held rotates q and k (else the fused path adds an identity rotation)
        self._all_rotate = all(
            layer.rotates for layer in self.layers if isinstance(layer, DecoderLayer)
        )
        # decode-only steps through the native layer loop (model/decode_plan.py): built
        # on the first one by ``decode_planner``, which the runner hands the model (that
        # module reads this one's layers, so this one may not import it); False once
        # found not to apply. native_decode=False keeps the Python loop (A/B
        # measurements, tests).
        self.native_decode = True
        self.decode_planner: Callable[[LlamaModel], tuple[Any, str]] | None = None
        self._decode_plan: Any = None
        self.decode_why = "the Python layer loop"  # which loop and why, for the start-up line
        self.deepstack: Deepstack | None = None  # a step's, see deepstack.injected
        # the step's LoRA rows while it has any (model.lora.active): the Python loop adds
        # them, or the native decode loop (decode_plan.DecodePlan.takes)
        self.adapters: LoraRows | None = None
        # the Python layer loop's between_layers interval (the native decode loop keeps
        # CHECK_EVERY: its segments are native calls, and decode steps are short)
        self.check_every = CHECK_EVERY
        # decode steps may be captured in CUDA graphs (where the attention backend can
        # be); False for a family whose attention reads the step's host-side lists
        self.cuda_graphs = True

    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        """Layer ``index`` of the model (a hybrid model's recurrent layers differ)."""
        return DecoderLayer(cfg, dtype, plan, index)

    def state_shapes(self, layer: int) -> tuple[tuple[int, ...], ...] | None:
        """The per-request state shapes of held layer ``layer`` (``ModelRunner`` keeps
        ``[slots, *shape]`` of each), or None: it attends over the paged KV cache."""
        return None

    def kv_layout(self, layer: int) -> tuple[int, int, int]:
        """Held layer ``layer``'s paged KV cache: (the held layer whose cache it reads,
        its own index unless it shares another's; KV heads; head size)."""
        return layer, self.num_kv_heads, self.cfg.head_dim

    def kv_cache_shapes(
        self, layer: int, num_blocks: int, block_size: int
    ) -> tuple[tuple[int, ...], ...]:
        """The shapes of held layer ``layer``'s cache tensors (``ModelRunner`` allocates
        them; a layer sharing another's cache is not asked): K in the attention
        backend's layout, then V (latent attention keeps one tensor, ``model.deepseek``)."""
        _, heads, head_dim = self.kv_layout(layer)
        shape = (num_blocks, block_size, heads, head_dim)
        return self.attn_impl.k_cache_shape(*shape), shape

    def state_bytes(self) -> int:
        """Bytes of one request's recurrent state over every layer held (float32; 0
        for a model that only attends)."""
        return sum(
            4 * int(torch.Size(shape).numel())
            for i in range(len(self.layers))
            for shape in self.state_shapes(i) or ()
        )

    def rope_table(self, max_positions: int) -> Tensor:
        """``[>= max_positions, D/2]`` complex64 rotations ``exp(i * pos * inv_freq)``
        (``layers.rope_rows``; the windowed layers' own table, if the family has one,
        grows alongside, ``_rope_local``).

        Called every step with the longest context, which grows by one per decode step:
        the table grows geometrically so that it is rebuilt O(log n) times, not per step
        (each row depends only on its position, so the size does not change values)."""
        if self._rope_cache is None or self._rope_cache.shape[0] < max_positions:
            size = max(
                max_positions,
                2 * (0 if self._rope_cache is None else self._rope_cache.shape[0]),
                256,
            )
            self._rope_cache = rope_rows(self.cfg, 0, size).to(self.norm.device)
            if self.cfg.rope_local_theta is not None:
                local = rope_rows(self.cfg, 0, size, self.cfg.rope_local_theta)
                self._rope_local = local.to(self.norm.device)
        return self._rope_cache

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, ...]],
        meta: AttentionMetadata,
        between_layers: Callable[[], None] | None = None,
        hidden: Tensor | None = None,
    ) -> Tensor:
        """``input_ids, positions: [T]`` -> hidden states ``[T, hidden]`` (final norm
        applied); ``positions`` is ``[3, T]`` for an M-RoPE model's rows over images;
        ``self.deepstack`` (set for the step by ``deepstack.injected``) adds Qwen3-VL's
        image rows to the first layers' outputs.
        Writes this step's K/V into ``kv_caches`` (one pair per layer held).

        A pipeline stage after the first starts from ``hidden`` (the previous stage's
        residual stream ``[T, hidden]``) instead of the embedding; a stage before the last
        returns its residual stream, without the final norm.

        ``between_layers`` is called after every ``CHECK_EVERY`` layers; it may raise to cut
        the step short, whose K/V writes then cover only the layers run so far."""
        tp = self.tp
        last = self.layer_range.stop == self.cfg.num_layers
        x = hidden if hidden is not None else self.embed_at(input_ids, positions)
        table = self.rope_table(int(meta.max_seq_len))
        ops = self.cpu_ops
        if ops is not None and isinstance(self.attn_impl, CpuAttention):
            pairs = self._rope_pairs(table, positions)  # [T, D/2, 2] (cos, sin) per table
            if not self._all_rotate:
                pairs.append(
                    torch.stack(
                        [torch.ones_like(pairs[0][..., 0]), torch.zeros_like(pairs[0][..., 0])], -1
                    )
                )
            delta: Tensor | None = None
            t = x.shape[0]  # decode only: one attention output buffer for all layers
            plan = self._native_plan() if meta.num_decodes == t else None
            if plan is not None and self.adapters is not None and not plan.takes(self.adapters):
                plan = None  # adapters the native loop cannot add (torch's ops)
            if plan is not None:
                delta = plan.run(x, pairs, kv_caches, meta, between_layers, self.adapters)
                if not last:
                    return x + delta
                return cast(Tensor, ops.rms_norm(x, delta, self.norm, self.cfg.rms_norm_eps))
            o_out = (
                torch.empty((t, self.num_heads * self.cfg.head_dim))
                if meta.num_decodes == t
                else None
            )
            for i, (layer, (kc, vc)) in enumerate(zip(self.layers, kv_caches, strict=True)):
                if between_layers is not None and i and i % self.check_every == 0:
                    between_layers()
                dl = cast(DecoderLayer, layer)
                rope = pairs[-1] if not dl.rotates else pairs[1 if dl.local_rope else 0]
                delta = dl.forward_fused(
                    x, delta, rope, kc, vc, meta, self.attn_impl, tp, ops, o_out
                )
                if self.deepstack is not None:  # (the layer's output is x + delta)
                    delta = self.deepstack.add(i, delta)
            if not last:
                return x if delta is None else x + delta
            return cast(Tensor, ops.rms_norm(x, delta, self.norm, self.cfg.rms_norm_eps))
        ropes = [r.unsqueeze(1) for r in self._ropes(table, positions)]  # [T, 1, D/2]
        for i, (layer, (kc, vc)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if between_layers is not None and i and i % self.check_every == 0:
                between_layers()
            dl = cast(DecoderLayer, layer)
            layer_rope = ropes[1 if dl.local_rope else 0] if dl.rotates else None
            x = layer(x, layer_rope, kc, vc, meta, self.attn_impl, tp)
            if self.deepstack is not None:
                x = self.deepstack.add(i, x)
        if not last:
            return x
        return self.final_norm(x)

    def _ropes(self, table: Tensor, positions: Tensor) -> list[Tensor]:
        """The rotations ``[T, D/2]`` complex64 of ``positions`` per table: global, then
        the windowed layers' (if any)."""
        if positions.dim() == 2:  # [3, T] (t, h, w): M-RoPE (engine.mrope)
            ropes = [
                mrope_rotations(
                    table, positions, self.cfg.mrope_section, self.cfg.mrope_interleaved
                )
            ]
        else:
            ropes = [table[positions]]
        if self._rope_local is not None:
            ropes.append(self._rope_local[positions])
        return ropes

    def _rope_pairs(self, table: Tensor, positions: Tensor) -> list[Tensor]:
        """``_ropes`` as float32 ``[T, D/2, 2]`` (cos, sin) pairs, for the fused path
        (decode rows: gathered into kept buffers, valid until the next step's)."""
        if positions.dim() == 2:
            return [torch.view_as_real(r) for r in self._ropes(table, positions)]
        tables = [table] if self._rope_local is None else [table, self._rope_local]
        if positions.shape[0] > RowGather.MAX_ROWS:
            return [torch.view_as_real(t)[positions] for t in tables]
        return [self._gather.rows(f"rope{i}", t, positions) for i, t in enumerate(tables)]

    def final_norm(self, x: Tensor) -> Tensor:
        """The plain path's norm after the last layer, ``[T, hidden]``."""
        return F.rms_norm(x, (x.shape[-1],), self.norm, self.cfg.rms_norm_eps)

    def embed_at(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """The first layer's input ``[T, hidden]`` for tokens at ``positions: [T]``: the
        embedding (a family with learned positions adds theirs)."""
        return self.embed(input_ids)

    def embed(self, input_ids: Tensor) -> Tensor:
        """``input_ids: [T]`` -> ``[T, hidden]``: the embedding rows (this rank's vocabulary
        slice, all-reduced, with tensor parallelism), times the family's scale."""
        if self.tp is not None:
            x = self._embed_slice(input_ids, self.tp)
        elif isinstance(self.embed_tokens, BlockWeight):
            x = self.embed_tokens.rows(input_ids)  # only the looked-up rows are dequantised
        else:
            x = F.embedding(input_ids, self.embed_tokens)
        return x * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else x

    @property
    def decode_path(self) -> str:
        """Which loop decode-only steps take: "native" once a plan is built (and
        ``native_decode`` is on), else "python"."""
        if not self.native_decode or self._decode_plan is None or self._decode_plan is False:
            return "python"
        return "native"

    def choose_decode_loop(self) -> str:
        """Decide (and build) now which loop decode-only steps take, and say it on stderr
        beside the start-up report (the runner calls it once its model is set up: the
        attention backend and tensor-parallel group known). Returns ``decode_path``."""
        if self.cpu_ops is not None:
            self._native_plan()
            sys.stderr.write(f"structllm: decode steps: {self.decode_why}\n")
        return self.decode_path

    def _native_plan(self) -> Any:
        """The native decode loop's plan (``decode_planner``'s), built on the first
        decode-only step (or by ``choose_decode_loop``), or None: turned off, or not for
        this model (said once)."""
        if not self.native_decode or self._decode_plan is False:
            return None
        plan = self._decode_plan
        if plan is not None and (plan.impl is not self.attn_impl or self.tp is not None):
            self._decode_plan = None  # another backend, or sharded, since: decide again
        if self._decode_plan is None and self.decode_planner is not None:
            plan, self.decode_why = self.decode_planner(self)
            log.info("decode steps: %s", self.decode_why)
            self._decode_plan = False if plan is None else plan
            if plan is None:
                return None
        return self._decode_plan

    def use_cpu_ops(self) -> bool:
        """Run the element-wise glue of each layer (norms, residual adds, rotary
        embedding and KV store, SiLU) through the fused C++ ops of ``cpu_layer.cpp``:
        about 1.5 ms less per decode step of the default model on 2 cores. For CPU
        float32 activations with the C++ attention (``CpuAttention``), in the non-exact
        formats only: the ops round differently from torch's (see the source), and the
        exact float32 path must stay token-for-token equal to transformers. Returns
        whether they are in use (False: not built here, or not that kind of model)."""
        from structllm.kernels import cpu_ext

        if self.norm.device.type != "cpu" or self.norm.dtype != torch.float32:
            return False
        self.cpu_ops = cpu_ext.load_layer()
        return self.cpu_ops is not None

    @property
    def num_heads(self) -> int:
        """Query heads held here (this rank's, with tensor parallelism)."""
        return self.plan.num_heads if self.plan else self.cfg.num_heads

    @property
    def num_kv_heads(self) -> int:
        """KV heads held (and cached) by this model: all of them, or its shard's."""
        return self.plan.num_kv_heads if self.plan else self.cfg.num_kv_heads

    def _embed_slice(self, input_ids: Tensor, tp: TensorParallelGroup) -> Tensor:
        """Vocabulary-parallel lookup: each rank fills the rows of the tokens in its slice
        and zeroes the rest; the all-reduce sums one real row and zeros per token, which
        is exact."""
        assert self.plan is not None
        local = input_ids - self.plan.vocab.start  # [T]
        outside = (local < 0) | (local >= len(self.plan.vocab))
        local = local.masked_fill(outside, 0)
        if isinstance(self.embed_tokens, BlockWeight):
            x = self.embed_tokens.rows(local)  # [T, hidden]
        else:
            x = F.embedding(local, self.embed_tokens)  # [T, hidden]
        x.masked_fill_(outside.unsqueeze(1), 0.0)
        tp.all_reduce(x)
        return x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, vocab]``. Sharded, every rank must call
        it with the same rows: rank 0 gets the full logits, any other rank its own slice
        ``[N, len(plan.vocab)]`` (which it has sent to rank 0)."""
        w: Weight = self.embed_tokens if self.lm_head is None else self.lm_head
        # GGUF blocks: never the int8 path (linear's default): when every matmul ran it,
        # about half of SmolLM2-135M's top-1 disagreement came from the head alone, and
        # the head only sees sampled rows. The int16 path (16-bit activations) is fine.
        head = self._packed_head if self._packed_head is not None else w
        logits = linear(hidden, head, self.lm_head_bias)
        if logits.dtype != torch.float32:  # (a no-op call on the CPU paths' float32)
            logits = logits.float()
        cfg = self.cfg
        if cfg.final_softcap and self.cpu_ops is not None and logits.is_contiguous():
            self.cpu_ops.soft_cap_(logits, cfg.final_softcap)  # fused path: one pool loop
        elif cfg.final_softcap:
            logits = soft_cap(logits, cfg.final_softcap)
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        if self.tp is None:
            return logits
        return self._gather_vocab(logits, self.tp)

    def _gather_vocab(self, logits: Tensor, tp: TensorParallelGroup) -> Tensor:
        """This rank's ``[N, V_r]`` slices -> ``[N, V]`` on rank 0. Gather needs equal
        shapes, so shorter slices are padded to the longest and trimmed after."""
        assert self.plan is not None
        sizes, stride = self.plan.vocab_sizes, self.plan.vocab_stride
        padded = (
            F.pad(logits, (0, stride - logits.shape[1]))
            if logits.shape[1] < stride
            else logits.contiguous()
        )
        parts = tp.gather_to_first(padded)
        if parts is None:
            return logits
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes, strict=True)], dim=1)

    LINEARS = DecoderLayer.LINEARS  # a dense layer's matmul weights

    def _packed_owners(self) -> list[tuple[nn.Module, tuple[str, ...]]]:
        """Every module holding matmul weights, with their names (layers, experts)."""
        return [
            (m, cast(tuple[str, ...], m.PACKED)) for m in self.modules() if hasattr(m, "PACKED")
        ]

    def assign_weights(self, weights: dict[str, Tensor | BlockWeight]) -> None:
        """Put the loaded weights in place of the empty parameters (names must match).
        A ``BlockWeight`` replaces its parameter as a plain attribute."""
        expected = {name for name, _ in self.named_parameters()}
        missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the model: missing {missing[:4]}, "
                f"unexpected {unexpected[:4]}"
            )
        for name, w in weights.items():
            owner_name, _, attr = name.rpartition(".")
            owner = self.get_submodule(owner_name) if owner_name else self
            del owner._parameters[attr]
            value = w if isinstance(w, BlockWeight) else nn.Parameter(w, requires_grad=False)
            setattr(owner, attr, value)
        for layer in self.layers:
            cast(DecoderLayer, layer)._norms = None  # (forward_fused reads them anew)
        self._decode_plan = None  # (built anew from these weights)

    def pack_weights(self, half: str = "none") -> None:
        """Repack the matmul weights for the CPU kernels that run them.

        ``half``: which float weights run as fbgemm float16 (``HalfWeight``): ``"all"``,
        ``"file"`` (the float16 ones, from F16/BF16 GGUF tensors) or ``"none"``. The other
        float32 ones are packed into oneDNN's blocked layout: oneDNN picks its kernels by
        the CPU's actual ISA, and with weights packed ahead of time its matmuls run about
        3x faster here than the default sgemm path, from one token (memory-bound) to
        thousands (compute-bound). Packed tensors are opaque, so they replace the
        parameters; a tied float embedding keeps its plain float32 copy for the lookup
        and gets a packed twin for the LM head. ``BlockWeight``s are left as they are.
        """
        if self.norm.device.type != "cpu":
            return
        onednn = onednn_linear_available()

        def pack(w: Weight) -> Weight | None:  # None: leave as is
            if isinstance(w, BlockWeight | HalfWeight):
                return None
            if half == "file" and w.dtype == torch.float16 and self.FILE_HALF_ROWS:
                rows = half_matrix(w)  # (None: no kernels here, fbgemm's below)
                if rows is not None:
                    return rows
            if half == "all" or (half == "file" and w.dtype == torch.float16):
                return HalfWeight(w)
            if w.dtype == torch.float16 and self.norm.dtype == torch.float32:
                w = w.float()  # a float16 tensor not run as float16: compute in float32
            if w.dtype == torch.float32 and onednn:
                return torch.ops.mkldnn._reorder_linear_weight(w.data)
            return w

        for owner, names in self._packed_owners():
            for name in names:
                packed = pack(getattr(owner, name))
                if packed is not None:
                    if name in owner._parameters:
                        del owner._parameters[name]
                    setattr(owner, name, packed)
        if isinstance(self.embed_tokens, Tensor) and self.embed_tokens.dtype != self.norm.dtype:
            self.embed_tokens = nn.Parameter(
                self.embed_tokens.to(self.norm.dtype), requires_grad=False
            )
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        self._packed_head = pack(head)
        if self.lm_head is not None and self._packed_head is not None:
            self.lm_head = None  # the packed head replaces it: keep one copy
        self._decode_plan = None  # (built anew from the packed weights)

    def weight_bytes(self) -> int:
        """Bytes held by weights (packed forms counted as what they hold)."""
        from structllm.kernels.packed import weight_bytes

        total = sum(p.numel() * p.element_size() for p in self.parameters())
        for owner, names in self._packed_owners():
            total += sum(
                weight_bytes(getattr(owner, n)) for n in names if n not in owner._parameters
            )
        for w in (self.embed_tokens, self._packed_head):
            if isinstance(w, BlockWeight | HalfWeight):
                total += w.nbytes
        return total


# ---------------------------------------------------------------------------------------
# Hugging Face tensor names


class HFNames:
    """Where a family's Hugging Face checkpoint keeps each of our tensors (suffixes after
    ``model.layers.{i}.``); None: the family has no such tensor. ``qkv``/``gate_up``:
    one fused tensor (Phi-3) instead of ``q``, ``k``, ``v`` / ``gate``, ``up``.
    ``norm_plus_one``: the checkpoint stores Gemma's ``w`` of ``(1 + w)``.
    ``rope_interleaved``: its q/k rows already pair rotary dimensions as ours do
    (GLM-4's rotation of ``x[0::2]`` with ``x[1::2]``), so they are not permuted."""

    q, k, v = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"
    qkv: str | None = None
    o = "self_attn.o_proj"
    gate, up, down = "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"
    gate_up: str | None = None
    q_norm, k_norm = "self_attn.q_norm", "self_attn.k_norm"
    input_layernorm: str | None = "input_layernorm"
    post_attention_layernorm: str | None = "post_attention_layernorm"
    attn_out_norm: str | None = None
    mlp_out_norm: str | None = None
    norm_plus_one = False
    rope_interleaved = False


# a multimodal checkpoint's text model (config.TEXT_MODELS): saved under
# language_model.model. (and by transformers 4.52-4.57 under model.language_model.;
# Idefics3's under model.text_model.); the vision tower and projector are not loaded
# here (the engine's vision side loads them)
_TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.text_model.": "model.",
}
_IMAGE_PARTS = ("vision_tower.", "multi_modal_projector.", "visual.", "vision_model.", "connector.")


def text_model_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` under a text model's names (see ``_TEXT_PREFIXES``), image parts out."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        old = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        if old is not None:
            out[_TEXT_PREFIXES[old] + name[len(old) :]] = t
        elif not name.removeprefix("model.").startswith(_IMAGE_PARTS):
            out[name] = t
    return out


def hf_to_native(
    state: dict[str, Tensor], cfg: ModelConfig, names: type[HFNames] = HFNames
) -> dict[str, Tensor]:
    """Hugging Face tensor names -> ours: fuse q/k/v and gate/up, interleave the rotary
    rows of q and k (and of their norms' weights), add Gemma's 1 to norm weights; a
    multimodal checkpoint's text model by its own names (``text_model_names``)."""
    state = text_model_names(state)

    def take(name: str) -> Tensor:
        return state.pop(name)

    def norm(name: str) -> Tensor:
        w = take(name)
        return w.float() + 1.0 if names.norm_plus_one else w  # transformers adds in float32

    nh, nkv, hd, rd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_dim

    def rot(w: Tensor, heads: int) -> Tensor:
        return w if names.rope_interleaved else interleave_rope_rows(w, heads, rd)

    out = {"embed_tokens": take("model.embed_tokens.weight"), "norm": norm("model.norm.weight")}
    if "lm_head.weight" in state and not cfg.tie_word_embeddings:
        out["lm_head"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        attends = cfg.attends(i)  # (a hybrid family maps its other layers itself)
        kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
        for kind in kinds if attends else ():
            if names.qkv is not None:
                q, k, v = take(f"{p}{names.qkv}.{kind}").split([nh * hd, nkv * hd, nkv * hd])
            else:
                q, k, v = (take(f"{p}{n}.{kind}") for n in (names.q, names.k, names.v))
            out[o + ("qkv_proj" if kind == "weight" else "qkv_bias")] = torch.cat(
                [rot(q, nh), rot(k, nkv), v]
            )
        if attends:
            out[o + "o_proj"] = take(f"{p}{names.o}.weight")
        if cfg.moe_layer(i):
            pass  # router and experts: the family's own mapping (model.moe)
        elif names.gate_up is not None:
            out[o + "gate_up_proj"] = take(f"{p}{names.gate_up}.weight")
            out[o + "down_proj"] = take(f"{p}{names.down}.weight")
        else:
            gate, up = take(f"{p}{names.gate}.weight"), take(f"{p}{names.up}.weight")
            out[o + "gate_up_proj"] = torch.cat([gate, up])
            out[o + "down_proj"] = take(f"{p}{names.down}.weight")
        if cfg.qk_norm != "none" and attends:
            heads = (1, 1) if cfg.qk_norm == "head" else (nh, nkv)
            out[o + "q_norm"] = rot(norm(f"{p}{names.q_norm}.weight"), heads[0])
            out[o + "k_norm"] = rot(norm(f"{p}{names.k_norm}.weight"), heads[1])
        for ours in (
            "input_layernorm",
            "post_attention_layernorm",
            "attn_out_norm",
            "mlp_out_norm",
        ):
            theirs = getattr(names, ours)
            if theirs is not None:
                out[o + ours] = norm(f"{p}{theirs}.weight")
    return out


MODEL = LlamaModel
