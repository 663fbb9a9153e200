"""Hybrid models: decoders whose layers either attend over the paged KV cache (the
shared ``DecoderLayer``) or run a recurrent mixer over a per-request state
(``RecurrentLayer``: LFM2's short convolution, Qwen3.5's Gated DeltaNet, Mamba-2), or
(Nemotron-H's MLP-only layers) neither: such a layer holds no KV blocks and no state
(``state_shapes`` ``()``; its cache entry is the empty tuple).

A recurrent layer is the pre-norm block of the shared decoder with its attention
replaced by a mixer: ``x + mixer(norm(x))``, then ``x + mlp(norm(x))``. Its state lives
in the runner's per-layer tensors (``state_shapes``), one row per slot of
``engine.state_cache``; the step's slot of each sequence comes in
``AttentionMetadata.state_slots`` (see ``model.recurrent``).

A family is a ``HybridModel`` subclass naming its mixer (``mixer``) and its
``hf_to_native``. Where the fused CPU ops are in use (the non-exact formats,
``LlamaModel.use_cpu_ops``), the layer loop runs them (``_forward_fused``): attention
layers by ``DecoderLayer.forward_fused``, recurrent layers' norms fused with their
residual adds and their MLPs' SiLU * up (``RecurrentLayer.forward_fused``); elsewhere,
and on the exact float32 path, the plain torch loop. Decode-only steps of a model whose
every recurrent mixer is LFM2's short convolution or Qwen3.5's Gated DeltaNet take the
native decode loop (``model.decode_plan``: attention and recurrent layers alike, one C++
call per ``CHECK_EVERY`` layers), and so do Granite 4's (Mamba-2) and Nemotron-H's
(Mamba-2, MLP and attention blocks); experts keep the fused layer loop. No CUDA
graphs; one process (no tensor or pipeline parallelism: refused at start), without
speculative decoding (a recurrent state cannot be rolled back past a rejected draft:
refused). Prefix caching resumes a cached prefix from the
state saved at its last block (``engine.state_cache``): ``forward`` copies it into the
request's slot first, and a chunk saves its state at a block boundary as its rows pass
it (``RecurrentBatch.prefills``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.attention import AttentionMetadata, CpuAttention
from structllm.kernels.packed import linear
from structllm.model.config import ModelConfig
from structllm.model.layers import SparseMoe, gated_act, mrope_rotations
from structllm.model.llama import CHECK_EVERY, DecoderLayer, LlamaModel, refuse_sharding
from structllm.model.recurrent import RecurrentBatch
from structllm.model.sharding import ShardPlan


class Mixer(Protocol):
    """A recurrent layer's token mixer: ``forward(x [T, hidden], states, rb)`` ->
    ``[T, hidden]``, updating ``states`` (its tensors ``[S, *state_shapes[j]]``) for the
    slots of ``rb``; ``PACKED``: its matmul weights."""

    PACKED: tuple[str, ...]

    def state_shapes(self) -> tuple[tuple[int, ...], ...]: ...

    def __call__(self, x: Tensor, states: tuple[Tensor, ...], rb: RecurrentBatch) -> Tensor: ...


class RecurrentLayer(nn.Module):
    """Pre-norm, mixer, residual; pre-norm, gated MLP (or experts), residual."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, mixer: nn.Module, index: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.eps, self.act = cfg.rms_norm_eps, cfg.mlp_act

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_layernorm = p(h)
        self.mixer = mixer
        self.post_attention_layernorm = p(h)
        self.moe = SparseMoe(cfg, dtype, None) if cfg.moe_layer(index) else None
        if self.moe is None:
            self.gate_up_proj = p(2 * cfg.intermediate_size, h)
            self.down_proj = p(h, cfg.intermediate_size)
        self.PACKED = () if self.moe else ("gate_up_proj", "down_proj")
        # each branch's output times this before its residual (Granite 4's multiplier)
        self.residual_scale = 1.0

    def forward(self, x: Tensor, states: tuple[Tensor, ...], rb: RecurrentBatch) -> Tensor:
        h = F.rms_norm(x, (x.shape[-1],), self.input_layernorm, self.eps)
        x = x + cast(Mixer, self.mixer)(h, states, rb)
        h = F.rms_norm(x, (x.shape[-1],), self.post_attention_layernorm, self.eps)
        if self.moe is not None:
            return x + self.moe(h, self.act)
        gate, up = linear(h, self.gate_up_proj, int8_ok=True).chunk(2, dim=-1)
        return x + linear(gated_act(gate, up, self.act), self.down_proj, int8_ok=True)

    def forward_fused(
        self,
        x: Tensor,
        delta: Tensor | None,
        states: tuple[Tensor, ...],
        rb: RecurrentBatch,
        ops: Any,
    ) -> Tensor:
        """``forward`` through the fused CPU ops (``cpu_layer.cpp``), with
        ``DecoderLayer.forward_fused``'s residual contract: ``x [T, hidden]`` is the
        residual stream before the previous layer's output ``delta`` (None: none) was
        added; both additions happen in place in ``x`` (each fused with the next norm),
        and this layer's MLP output is returned as the next delta."""
        r = self.residual_scale
        h = ops.rms_norm(x, delta, self.input_layernorm, self.eps)  # x += delta
        mixed = cast(Mixer, self.mixer)(h, states, rb)  # [T, hidden]
        if r != 1.0:
            mixed = mixed * r
        h = ops.rms_norm(x, mixed, self.post_attention_layernorm, self.eps)  # x += mixed
        fused_act = ops.gelu_tanh_mul if self.act == "gelu_tanh" else ops.silu_mul
        if self.moe is not None:
            out = self.moe(h, self.act, fused_act)
        else:
            mid = fused_act(linear(h, self.gate_up_proj, int8_ok=True))  # [T, F]
            out = linear(mid, self.down_proj, int8_ok=True)
        return out if r == 1.0 else out * r


class HybridModel(LlamaModel):
    """``LlamaModel`` whose recurrent layers (``ModelConfig.layer_types``) are
    ``RecurrentLayer``s around the family's ``mixer``."""

    # where the fused CPU ops are in use: their layer loop (False: the plain one, as the
    # exact path runs; for A/B measurements, bench/models.py's auto:plain-layers, and tests)
    fused_layers = True

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        plan: ShardPlan | None = None,
        layers: range | None = None,
    ) -> None:
        why = (
            f"{cfg.architecture} is a hybrid model (recurrent layers): it runs in one "
            "process, without tensor or pipeline parallelism"
        )
        refuse_sharding(cfg, plan, layers, why)
        super().__init__(cfg, dtype, plan, layers)
        self._recurrent: Any = None  # cpu_recurrent.cpp's module, once loaded (False: none)

    def mixer(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> nn.Module:
        raise NotImplementedError

    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        if cfg.attends(index):
            return DecoderLayer(cfg, dtype, plan, index)
        return RecurrentLayer(cfg, dtype, self.mixer(cfg, dtype, index), index)

    def state_shapes(self, layer: int) -> tuple[tuple[int, ...], ...] | None:
        """None for an attention layer (a ``DecoderLayer``: K/V blocks), its mixer's
        states for a recurrent one; ``()`` for a layer with neither (Nemotron-H's
        MLP-only layers): no KV blocks and no state."""
        held = self.layers[layer]
        if isinstance(held, DecoderLayer):
            return None
        mixer = getattr(held, "mixer", None)
        return () if mixer is None else cast(Mixer, mixer).state_shapes()

    def state_bytes(self) -> int:
        """Bytes of one request's recurrent state over every layer (float32)."""
        total = 0
        for i in range(len(self.layers)):
            for shape in self.state_shapes(i) or ():
                total += 4 * int(torch.Size(shape).numel())
        return total

    def _load_saved_states(
        self, kv_caches: list[tuple[Tensor, ...]], loads: list[tuple[int, int]]
    ) -> None:
        """Copy each ``(saved row, slot)`` of ``loads`` in every recurrent layer's state
        tensors: a request resuming a cached prefix starts from the state saved at its
        end (``engine.state_cache``). Before any layer runs, so a saved row that this
        step's saves overwrite is read first."""
        device = self.norm.device
        src = torch.tensor([r for r, _ in loads], dtype=torch.long, device=device)
        dst = torch.tensor([s for _, s in loads], dtype=torch.long, device=device)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            if not isinstance(layer, DecoderLayer):
                for t in cache:  # [R, ...]
                    t.index_copy_(0, dst, t.index_select(0, src))

    def _recurrent_kernels(self) -> Any:
        """The native decode kernels of the recurrent layers (``cpu_recurrent.cpp``)
        where the fused CPU ops are in use (the non-exact formats), else None."""
        if self.cpu_ops is None:
            return None
        if self._recurrent is None:
            from structllm.kernels import cpu_ext

            self._recurrent = cpu_ext.load_recurrent() or False
        return self._recurrent or None

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, ...]],
        meta: AttentionMetadata,
        between_layers: Callable[[], None] | None = None,
        hidden: Tensor | None = None,
    ) -> Tensor:
        """As ``LlamaModel.forward`` (one process: ``hidden`` is only ever the input
        embeddings with image rows in place, Qwen3.5's): an attention layer's cache entry
        is its (K, V) pair, a recurrent layer's its states."""
        x = hidden if hidden is not None else self.embed(input_ids)
        table = self.rope_table(int(meta.max_seq_len))
        if positions.dim() == 2:  # [3, T] (t, h, w): M-RoPE (engine.mrope)
            cfg = self.cfg
            rows = mrope_rotations(table, positions, cfg.mrope_section, cfg.mrope_interleaved)
        else:
            rows = table[positions]  # [T, D/2] complex64
        rb = RecurrentBatch.from_meta(meta, meta.state_slots, self._recurrent_kernels())
        if meta.state_loads:
            self._load_saved_states(kv_caches, meta.state_loads)
        ops = self.cpu_ops
        if ops is not None and self.fused_layers and isinstance(self.attn_impl, CpuAttention):
            return self._forward_fused(x, rows, kv_caches, meta, rb, ops, between_layers)
        rope = rows.unsqueeze(1)  # [T, 1, D/2]
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if between_layers is not None and i and i % CHECK_EVERY == 0:
                between_layers()
            if isinstance(layer, DecoderLayer):
                kc, vc = cache
                x = layer(x, rope if layer.rotates else None, kc, vc, meta, self.attn_impl)
            else:
                x = layer(x, cache, rb)
        return F.rms_norm(x, (x.shape[-1],), self.norm, self.cfg.rms_norm_eps)

    @staticmethod
    def _identity_pair(pair: Tensor) -> Tensor:
        """cos 1, sin 0 shaped as ``pair [T, D/2, 2]``: a NoPE layer's rotation."""
        ones = torch.ones_like(pair[..., 0])
        return torch.stack([ones, torch.zeros_like(ones)], -1)

    def _forward_fused(
        self,
        x: Tensor,
        rows: Tensor,
        kv_caches: list[tuple[Tensor, ...]],
        meta: AttentionMetadata,
        rb: RecurrentBatch,
        ops: Any,
        between_layers: Callable[[], None] | None,
    ) -> Tensor:
        """``forward``'s layer loop through the fused CPU ops: each layer adds the
        previous one's output to ``x`` in place, fused with its first norm
        (``DecoderLayer.forward_fused``, ``RecurrentLayer.forward_fused``, and those of
        a layer marked ``fused_block``: Nemotron-H's attention, Mamba-2, MLP and MoE
        blocks, whose output is their one sublayer's). ``rows: [T, D/2]`` complex64
        rotations. A layer with experts runs them through the fused router and the native
        expert call (``SparseMoe.forward`` with the fused activation), as the decode loop
        does; a layer of another kind runs its own ``forward`` on the stream with the
        pending output added."""
        pair = torch.view_as_real(rows)  # [T, D/2, 2] (cos, sin)
        identity: Tensor | None = None  # for a NoPE layer (the store still runs)
        delta: Tensor | None = None
        plan = self._native_plan() if meta.num_decodes == x.shape[0] else None
        if plan is not None and self.adapters is None and rb.native is not None:
            # the rotations [T, D/2, 2] (contiguous, as the native call takes them; M-RoPE's
            # may not be), then cos 1, sin 0 for a NoPE layer (decode_plan's identity
            # table: 1, as no hybrid family has a local rope table)
            pair = pair.contiguous()
            pairs = [pair] if self._all_rotate else [pair, self._identity_pair(pair)]
            nd = rb.num_decodes
            states = (rb.slots[:nd], rb.fresh_mask[:nd])
            delta = plan.run(x, pairs, kv_caches, meta, between_layers, None, states)
            return cast(Tensor, ops.rms_norm(x, delta, self.norm, self.cfg.rms_norm_eps))
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if between_layers is not None and i and i % CHECK_EVERY == 0:
                between_layers()
            block = getattr(layer, "fused_block", False)  # Nemotron-H's (see the docstring)
            attention = type(layer) is DecoderLayer or block
            if isinstance(layer, DecoderLayer) and attention and not layer.local_rope:
                rope = pair
                if not layer.rotates:
                    if identity is None:
                        identity = self._identity_pair(pair)
                    rope = identity
                kc, vc = cache
                delta = layer.forward_fused(
                    x, delta, rope, kc, vc, meta, self.attn_impl, None, ops, None
                )
            elif isinstance(layer, RecurrentLayer) or block:
                delta = cast(RecurrentLayer, layer).forward_fused(x, delta, cache, rb, ops)
            else:
                if delta is not None:
                    x.add_(delta)
                    delta = None
                if isinstance(layer, DecoderLayer):
                    kc, vc = cache
                    plain_rope = rows.unsqueeze(1) if layer.rotates else None  # [T, 1, D/2]
                    x = layer(x, plain_rope, kc, vc, meta, self.attn_impl)
                else:
                    x = layer(x, cache, rb)
        return cast(Tensor, ops.rms_norm(x, delta, self.norm, self.cfg.rms_norm_eps))
