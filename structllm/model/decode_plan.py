"""The native decode step: a decode-only step's decoder layers in one C++ call per
segment of ``CHECK_EVERY`` layers (``kernels/cpu_decode.cpp``), instead of
``DecoderLayer.forward_fused``'s ~9 Python-dispatched kernel calls per layer.

A ``DecodePlan`` is built once per model (on its first decode-only step, when the
attention backend and KV caches are known) from each layer's weights: the raw GGUF block
tensors and type codes of its four matrices (each part of a ``MixedWeight``), its norm
weights, q/k norm, activation, window, soft-cap, scale and residual multiplier. Each
step then passes the residual stream, the rotary tables, the slots and block tables and
the two kernel modes (``packed.block_mode`` of the step's rows, with and without int8).
The native loop calls the very kernels ``forward_fused`` calls, in the same order and
modes, so the hidden states are bit for bit the same (tests/engine/test_decode_plan.py).

gpt-oss's layers (``model.gpt_oss``) run here too: its attention sinks go to the
attention kernel, ``o_proj``'s bias is added as ``linear`` adds it, and its router's bias
and softmax over the top-k logits are ``cpu_moe.cpp``'s ``route`` modes
(``SparseMoe.native_route``).

A mixture-of-experts layer whose experts run natively (``SparseMoe.native_experts``: GGUF
blocks or float16 rows, SiLU or gpt-oss's clamped SwiGLU, a float32 router) runs its MLP
inside the native call too:
the router and ``cpu_moe.cpp``'s ``Experts`` through that module's ``moe_ops`` table, the
very functions ``SparseMoe.forward`` calls, so a MoE model's step is one native call per
``CHECK_EVERY`` layers, as a dense one's. Any other MoE layer runs natively up to its MLP's
input and ends its native call; its experts (the Python loop) are called from here
before the next one, then its output norm and multiplier as ``forward_fused`` applies
them.

A step with LoRA adapter rows (``model.lora.LoraRows``) runs here too when the rows'
kernels are the native ones (``LoraRows.native``, cpu_lora.cpp built): the step's
adapters' parts go to the native call as one ``LoraItems`` (built once per set of
adapters in order, kept in ``LoraRows.plans``), with the step's rows by adapter, and
``cpu_decode.cpp`` adds ``B (A x)`` for those rows after each adapted matmul through
the row kernels ``lora_add`` runs for the Python loop (``cpu_lora.h``): the same bits.

Hybrid models (``model.hybrid``): their attention layers run here as any other
(Qwen3.5's output gate too: ``set_attn_gate``), and their recurrent layers when every
mixer is LFM2's short convolution (``add_conv_layer``: in_proj, ``B * x'``, the
convolution's step, ``C * y``, out_proj, the dense MLP) or Qwen3.5's Gated DeltaNet
(``add_delta_layer``: ``GatedDeltaNet._native_rule``'s kernels in its order) or
Granite 4's Mamba-2 (``add_mamba_layer``: ``Mamba2._native_scan``'s kernels), the
recurrent kernels through ``cpu_recurrent.cpp``'s ``RecurrentOps`` (``cpu_hybrid.h``:
the functions its Python entry points run), each row's state slot and fresh flag
passed per step (``HybridModel._forward_fused``). Nemotron-H's blocks run here too
(attention alone: ``add_layer(mlp=False)``; Mamba-2 alone: ``add_mamba_layer`` without
an MLP; ``add_mlp_layer``: ``down(relu(up h)^2)``; Nemotron 3's ``MoeBlock``:
``add_moe_block``, cpu_mla.cpp's ``group_route`` through its ``MlaOps`` table, the relu²
experts between the latent projections, the shared MLP). Experts in a hybrid model's layers
(Qwen3.5-MoE's, Qwen3-Next's, Granite 4's) run as in the other models: natively where
``_native_experts`` allows (a recurrent layer's through ``set_experts``), else from
Python between two native calls (a cut), bit for bit as the Python loop runs them.

DeepSeek's latent-attention layers (``model.deepseek``) run here when cpu_mla.cpp is in
use, every matrix is in GGUF blocks and the experts are native (``_latent_why_not``):
``DeepseekLayer.forward_native``'s kernels in its order (``add_mla_layer``), cpu_mla.cpp's
``store_latent``, ``decode`` and ``group_route`` through its ``MlaOps`` table
(``cpu_mla.h``), the experts through ``moe_ops``, the shared experts' MLP added after them.

Gemma 4's layers (``model.gemma4``) run here too (``add_gemma4_layer``), each at its
own KV heads, head size and MLP width: the values' weightless norm, KV-shared layers
attending over their source layer's cache (the runner hands them its tensors), the
per-layer inputs (``PerLayerInputs``, computed in Python before the call and passed as
one ``[T, L, P]`` tensor) and the layer scalar. The kernels are the fused path's
(``cpu_layer.cpp``'s norms, rotary store and GeGLU) where ``Gemma4Layer.forward`` runs
torch's, so the hidden states agree within float rounding, not bit for bit
(tests/engine/test_decode_plan_gemma4.py). 26B-A4B's experts beside the dense MLP run
in the call too (``set_gemma4_experts``: its own router's scales, cpu_moe.cpp's GeGLU
experts, the three extra norms).

What it takes: the fused CPU path (``LlamaModel.use_cpu_ops``) with ``CpuAttention``, no
tensor parallelism, every layer matrix (q/k/v, o, and a dense layer's gate/up and down)
in GGUF blocks (``BlockWeight``/``MixedWeight``) or float16 rows (``HalfMatrix``: an
F16 file's); not fbgemm's float16 ``HalfWeight``s (a float checkpoint's default format)
or float32. Anything else, and every prefill or mixed step, keeps the Python path.
``STRUCTLLM_DECODE_PLAN=0`` turns it off (for A/B measurements);
``LlamaModel.native_decode = False`` does the same in-process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from structllm.kernels.attention import AttentionMetadata, CpuAttention
from structllm.kernels.packed import HalfWeight, block_mode, kernel_parts
from structllm.model.deepseek import DeepseekLayer, DeepseekModel
from structllm.model.gemma4 import Gemma4Layer, Gemma4Model
from structllm.model.hybrid import HybridModel, RecurrentLayer
from structllm.model.llama import CHECK_EVERY, DecoderLayer, LlamaModel
from structllm.model.lora import LoraRows

PROJECTIONS = ("qkv", "o", "gate_up", "down")  # cpu_decode.cpp's projection numbers

ENABLED = os.environ.get("STRUCTLLM_DECODE_PLAN", "1") != "0"


def plan(model: LlamaModel) -> tuple[DecodePlan | None, str]:
    """``LlamaModel.decode_planner``: the native loop's plan for ``model`` and the
    start-up line's words for it, or None and why the Python loop runs instead."""
    from structllm.kernels import cpu_ext

    reason = why_not(model)
    native = cpu_ext.load_decode() if reason is None else None
    if reason is None and native is None:
        reason = "the native driver did not build"
    latent = isinstance(model, DeepseekModel) and model.mla is not None
    if reason is not None:
        if latent:  # (DeepseekModel._forward_native's loop)
            return None, f"the Python layer loop on the fused CPU ops (cpu_mla.cpp; {reason})"
        return None, f"the Python layer loop ({reason})"
    words = "the native layer loop (cpu_decode.cpp" + (", cpu_mla.cpp)" if latent else ")")
    return DecodePlan(model, native, CHECK_EVERY), words


def why_not(model: LlamaModel) -> str | None:
    """Why ``model``'s decode steps cannot take the native loop (None: they can)."""
    if not ENABLED:
        return "off (STRUCTLLM_DECODE_PLAN=0)"
    if model.cpu_ops is None:
        return "not on the fused CPU path"
    if model.tp is not None:
        return "tensor parallelism"
    if isinstance(model, DeepseekModel):  # (its attention is cpu_mla.cpp's, any backend)
        return _latent_why_not(model)
    if not isinstance(model.attn_impl, CpuAttention):
        return "attention backend is not the CPU kernel"
    if isinstance(model, Gemma4Model):
        return _gemma4_why_not(model)
    if isinstance(model, HybridModel):
        why = _hybrid_why_not(model)
        if why is not None:
            return why
    for layer in model.layers:
        if not isinstance(layer, DecoderLayer):
            continue  # a hybrid model's other layers (_hybrid_why_not's)
        dl: DecoderLayer = layer
        if getattr(dl, "o_bias", None) is not None and getattr(dl, "sinks", None) is None:
            return "an output bias outside gpt-oss's layer is not in it"
        if getattr(dl, "attn_gate", None) is not None and kernel_parts(dl.attn_gate, False) is None:
            return "attn_gate is not in GGUF blocks"
        if getattr(dl, "chunk", 0) or getattr(dl, "scale_queries", None) is not None:
            return "chunked attention and query temperatures (Llama 4) are not in it"
        for name in dl.PACKED:  # a mixture-of-experts layer's: q/k/v and o
            if kernel_parts(getattr(dl, name), False) is None:
                return f"{name} is not in GGUF blocks"
    return None


def _hybrid_why_not(model: HybridModel) -> str | None:
    """Why a hybrid model's decode steps cannot take the native loop (None: as far as
    its recurrent layers go, they can): LFM2's short convolutions, Qwen3.5's Gated
    DeltaNet (with 16-float multiples for head widths, as its native rule asks),
    Granite 4's Mamba-2 layers and Nemotron-H's blocks (experts apart) are."""
    from structllm.kernels import cpu_ext
    from structllm.model.deltanet import GatedDeltaNet
    from structllm.model.lfm2 import ShortConv
    from structllm.model.mamba2 import Mamba2
    from structllm.model.nemotron_h import AttentionBlock, MambaBlock, MlpBlock, MoeBlock

    if cpu_ext.load_recurrent() is None:
        return "the recurrent kernels did not build"
    for layer in model.layers:
        if type(layer) in (DecoderLayer, AttentionBlock):
            continue
        if isinstance(layer, MoeBlock):
            why = _moe_block_why_not(layer)
            if why is not None:
                return why
            continue
        if isinstance(layer, MlpBlock):
            for name in MlpBlock.PACKED:
                if kernel_parts(getattr(layer, name), True) is None:
                    return f"{name} is not in GGUF blocks"
            continue
        if not isinstance(layer, (RecurrentLayer, MambaBlock)):
            return f"{type(layer).__name__} layers are not in it"
        mixer = layer.mixer
        linears: tuple[str, ...]
        if isinstance(mixer, ShortConv):
            conv, linears = mixer.conv, ("in_proj", "out_proj")
        elif isinstance(mixer, GatedDeltaNet):
            if mixer.head_k_dim % 16 or mixer.head_v_dim % 16:
                return "Gated DeltaNet heads not 16-float multiples wide"
            conv, linears = mixer.conv1d, GatedDeltaNet.LINEARS
        elif isinstance(mixer, Mamba2):
            conv, linears = mixer.conv1d, Mamba2.PACKED
        else:
            return f"the {type(mixer).__name__} mixer is not in it"
        if conv.dtype != torch.float32:
            return "the convolution's filter is not float32"
        for name in linears:
            if kernel_parts(getattr(mixer, name), False) is None:
                return f"{name} is not in GGUF blocks"
        if isinstance(layer, MambaBlock) or layer.moe is not None:  # (no MLP; experts)
            continue
        for name in ("gate_up_proj", "down_proj"):
            if kernel_parts(getattr(layer, name), True) is None:
                return f"{name} is not in GGUF blocks"
    return None


def _moe_block_why_not(block: Any) -> str | None:
    """Why Nemotron 3's MoE block (``nemotron_h.MoeBlock``) cannot run in the native
    call (None: it can): cpu_mla.cpp's router and cpu_moe.cpp's experts built, a float32
    router and bias, the latent projections and the shared MLP in GGUF blocks."""
    if block.native_router is None:
        return "the grouped router (cpu_mla.cpp) is not in use"
    if block.router.dtype != torch.float32 or not block.router.is_contiguous():
        return "the router is not float32"
    if block.router_bias.dtype != torch.float32:
        return "the router's bias is not float32"
    if block.native_experts() is None:
        return "the experts are not native (cpu_moe.cpp)"
    for name in ("latent_down", "latent_up"):
        w = getattr(block, name)
        if w is not None and kernel_parts(w, False) is None:
            return f"{name} is not in GGUF blocks"
    for w in (block.shared.up_proj, block.shared.down_proj):
        if kernel_parts(w, True) is None:
            return "the shared expert is not in GGUF blocks"
    return None


def _gemma4_why_not(model: Gemma4Model) -> str | None:
    """Why a Gemma 4 model's decode steps cannot take the native loop (None: they can):
    experts (if any) on cpu_moe.cpp, no ``attention_k_eq_v`` layers, every matrix in GGUF
    blocks (the per-layer input projections may be float)."""
    for layer in model.layers:
        gl: Gemma4Layer = layer  # type: ignore[assignment]
        if gl.moe is not None and gl.moe.native_experts() is None:
            return "Gemma 4's experts are not native (cpu_moe.cpp)"
        if gl.k_eq_v:  # (a GGUF file's such layers load as projections of their own)
            return "values that are the keys' projection (attention_k_eq_v) are not in it"
        for name in gl.PACKED:
            w = getattr(gl, name)
            small = name.startswith("per_layer_")  # (float runs too: _parts_or_float)
            if kernel_parts(w, False) is None and not (small and _is_float(w)):
                return f"{name} is not in GGUF blocks"
    return None


def _latent_why_not(model: DeepseekModel) -> str | None:
    """Why a DeepSeek model's decode steps cannot take the native loop (None: they can):
    it takes them on cpu_mla.cpp's kernels, every matrix in GGUF blocks, k_b and v_b
    float32, the experts native (cpu_moe.cpp) with a float32 router."""
    from structllm.kernels import cpu_ext

    if model.mla is None:
        return "cpu_mla.cpp is not in use"
    for layer in model.layers:
        dl: DeepseekLayer = layer  # type: ignore[assignment]
        a = dl.attn
        if a.k_b.dtype != torch.float32 or a.v_b.dtype != torch.float32:
            return "k_b and v_b are not float32"
        for name in a.PACKED:
            if kernel_parts(getattr(a, name), False) is None:
                return f"{name} is not in GGUF blocks"
        moe = dl.moe
        if moe is None:
            for name in dl.PACKED:
                if kernel_parts(getattr(dl, name), True) is None:
                    return f"{name} is not in GGUF blocks"
            continue
        if cpu_ext.load_moe() is None:
            return "the expert kernels did not build"
        bias = moe.router_bias
        if moe.router.dtype != torch.float32 or not moe.router.is_contiguous():
            return "the router is not float32"
        if bias is not None and bias.dtype != torch.float32:
            return "the router's bias is not float32"
        if moe.native_experts() is None:
            return "the experts are not native (cpu_moe.cpp)"
        if moe.shared is not None:
            for w in (moe.shared.gate_up_proj, moe.shared.down_proj):
                if kernel_parts(w, True) is None:
                    return "the shared experts are not in GGUF blocks"
    return None


class DecodePlan:
    """A model's layers as the native driver holds them (see the module docstring)."""

    def __init__(self, model: LlamaModel, native: Any, check_every: int) -> None:
        cfg = model.cfg
        self.impl = model.attn_impl  # the backend whose kernel it runs
        # DecoderLayers, and a hybrid model's RecurrentLayers (see _hybrid_why_not)
        self.layers: list[Any] = list(model.layers)
        # each MoE layer's native experts (None: its experts run from Python, a cut);
        # held here too, since the native plan keeps only their address
        from structllm.model.nemotron_h import AttentionBlock, MambaBlock, MlpBlock, MoeBlock

        latent = isinstance(model, DeepseekModel)
        self.experts = [
            (dl.moe.native_experts() if dl.moe is not None else None)
            if latent or isinstance(dl, Gemma4Layer)
            else dl.native_experts()
            if isinstance(dl, MoeBlock)
            else _native_experts(dl)
            for dl in self.layers
        ]
        moe_ops = None
        if any(e is not None for e in self.experts):
            from structllm.kernels import cpu_ext

            moe_ops = cpu_ext.load_moe().moe_ops()  # type: ignore[union-attr]
        # cpu_mla.cpp's table: a latent-attention model's kernels, or (Nemotron 3's MoE
        # blocks) its grouped router alone
        blocks = [dl for dl in self.layers if isinstance(dl, MoeBlock)]
        mla_ops = (
            cast(DeepseekModel, model).mla.mla_ops()
            if latent
            else blocks[0].native_router.mla_ops()
            if blocks
            else None
        )

        recurrent_ops = None
        if any(isinstance(dl, (RecurrentLayer, MambaBlock)) for dl in self.layers):
            from structllm.kernels import cpu_ext

            recurrent_ops = cpu_ext.load_recurrent().recurrent_ops()  # type: ignore[union-attr]
        self.native = native.DecodePlan(
            **native.tables,
            # (None for a latent-attention model, whose backend may be torch's)
            attention_ops=(
                model.attn_impl.module.attention_ops()
                if isinstance(model.attn_impl, CpuAttention)
                else None
            ),
            hidden=cfg.hidden_size,
            heads=model.num_heads,
            kv_heads=model.num_kv_heads,
            head_dim=cfg.head_dim,
            ffn=cfg.intermediate_size,
            eps=cfg.rms_norm_eps,
            moe_ops=moe_ops,
            recurrent_ops=recurrent_ops,
            mla_ops=mla_ops,
        )
        identity = 2 if cfg.rope_local_theta is not None else 1  # forward's last table
        for i, (dl, experts) in enumerate(zip(self.layers, self.experts, strict=True)):
            if isinstance(dl, DeepseekLayer):
                self._add_latent(dl, experts)
            elif isinstance(dl, Gemma4Layer):
                self._add_gemma4(dl, i, cfg.intermediate_size_of(i), experts)
            elif isinstance(dl, RecurrentLayer):
                self._add_recurrent(dl)
                if experts is not None:  # (else its experts run from Python: a cut)
                    last = self.native.num_layers() - 1
                    route = dl.moe.native_route()  # type: ignore[union-attr]
                    self.native.set_experts(
                        last,
                        experts.handle(),
                        dl.moe.router,  # type: ignore[union-attr]
                        dl.moe.top_k,  # type: ignore[union-attr]
                        dl.moe.renormalise,  # type: ignore[union-attr]
                        route[0] if route else None,
                        bool(route and route[1]),
                    )
            elif isinstance(dl, MambaBlock):  # Nemotron-H's blocks: one sublayer each
                self._add_mamba(dl, dl.mixer, mlp=False)
            elif isinstance(dl, MlpBlock):
                up, down = kernel_parts(dl.up_proj, True), kernel_parts(dl.down_proj, True)
                self.native.add_mlp_layer(in_norm=dl.input_layernorm, up=up, down=down)
            elif isinstance(dl, MoeBlock):
                self._add_moe_block(dl, experts)
            else:
                self._add(dl, identity, experts, mlp=not isinstance(dl, AttentionBlock))
                if getattr(dl, "attn_gate", None) is not None:  # Qwen3.5's gated attention
                    last = self.native.num_layers() - 1
                    self.native.set_attn_gate(last, kernel_parts(dl.attn_gate, False))
        for i, (dl, experts) in enumerate(zip(self.layers, self.experts, strict=True)):
            moe = getattr(dl, "moe", None)  # (a MoeBlock's shared MLP: _add_moe_block's)
            if experts is not None and moe is not None and not latent and moe.shared is not None:
                self.native.set_shared(i, *_shared_parts(moe))  # type: ignore[misc]
        self.ops: Any = model.cpu_ops  # the fused layer ops (cpu_layer.cpp), for the experts
        self.module = native  # (its LoraItems)
        q, kv = model.num_heads * cfg.head_dim, model.num_kv_heads * cfg.head_dim
        h, f = cfg.hidden_size, cfg.intermediate_size
        # the four projections' input and output widths, in PROJECTIONS' order
        self.widths = ([h, q, h, f], [q + 2 * kv, h, 2 * f, h])
        self._caches: list[tuple[Tensor, ...]] | None = None
        self.segments = self._segments(check_every)
        # without a check between them, the segments that end without a cut run as one
        # native call (each call converts ~10 arguments and checks the step: a few us
        # of a cold step apiece, ~8 a step of the default model)
        self.unchecked = self._merged()

    def _segments(self, check_every: int) -> list[tuple[int, int, bool]]:
        """``(begin, end, check first)`` per native call: ``check_every`` layers (the
        ``between_layers`` check before each group but the first, as in
        ``LlamaModel.forward``), cut after each mixture-of-experts layer whose experts
        run from Python between two calls (``cut``)."""
        n, begin = len(self.layers), 0
        out = []
        while begin < n:
            end = min(n, (begin // check_every + 1) * check_every)
            end = next((i + 1 for i in range(begin, end) if self.cut(i)), end)
            out.append((begin, end, begin > 0 and begin % check_every == 0))
            begin = end
        return out

    def _merged(self) -> list[tuple[int, int, bool]]:
        """``segments`` run without ``between_layers``: ``(begin, end, cut after end - 1)``,
        one call up to each cut layer (and the last)."""
        out: list[tuple[int, int, bool]] = []
        begin = 0
        for _, end, _ in self.segments:
            if self.cut(end - 1) or end == len(self.layers):
                out.append((begin, end, self.cut(end - 1)))
                begin = end
        return out

    def cut(self, i: int) -> bool:
        """Layer ``i``'s experts run from Python (its native call ends at its MLP input)."""
        return getattr(self.layers[i], "moe", None) is not None and self.experts[i] is None

    def _add(self, dl: DecoderLayer, identity: int, experts: Any, mlp: bool = True) -> None:
        """An attention layer; without ``mlp``, attention alone (Nemotron-H's block)."""
        # the rope table forward hands forward_fused: 0 global, 1 local, or the identity
        rope = (1 if dl.local_rope else 0) if dl.rotates else identity
        qk = dl.qk_norm != "none"
        route = dl.moe.native_route() if experts is not None else None  # type: ignore[union-attr]
        self.native.add_layer(
            in_norm=dl.input_layernorm,
            qkv=kernel_parts(dl.qkv_proj, False),
            qkv_bias=dl.qkv_bias,
            q_norm=dl.q_norm if qk else None,
            k_norm=dl.k_norm if qk else None,
            rope=rope,
            scale=dl.scale,
            window=dl.window,
            softcap=dl.softcap,
            o=kernel_parts(dl.o_proj, dl.O_INT8),
            attn_out_norm=dl.attn_out_norm,
            post_norm=dl.post_attention_layernorm,
            # int8 allowed: see DecoderLayer.forward
            gate_up=[] if dl.moe or not mlp else kernel_parts(dl.gate_up_proj, True),
            gelu=dl.act == "gelu_tanh",
            down=[] if dl.moe or not mlp else kernel_parts(dl.down_proj, True),
            mlp_out_norm=dl.mlp_out_norm,
            residual_scale=dl.residual_scale,
            moe=dl.moe is not None,
            experts=None if experts is None else experts.handle(),
            router=None if experts is None else dl.moe.router,  # type: ignore[union-attr]
            top_k=0 if experts is None else dl.moe.top_k,  # type: ignore[union-attr]
            renormalise=experts is not None and dl.moe.renormalise,  # type: ignore[union-attr]
            sinks=dl.sinks,
            o_bias=_vector(dl.o_bias),
            router_bias=route[0] if route else None,
            softmax_chosen=bool(route and route[1]),
            mlp=mlp,
        )

    def _add_latent(self, dl: DeepseekLayer, experts: Any) -> None:
        """A DeepSeek layer (``DeepseekLayer.forward_native``'s weights): the latent
        attention's projections, norms, ``k_b``/``v_b``, then its dense MLP or its experts
        with DeepSeek's grouped router and the shared experts."""
        a, moe = dl.attn, dl.moe
        shared = moe.shared if moe is not None else None
        pick = moe.pick if moe is not None else None
        self.native.add_mla_layer(
            in_norm=dl.input_layernorm,
            q_a=kernel_parts(a.q_a_proj, False) if a.q_lora else [],
            q_a_norm=a.q_a_norm if a.q_lora else None,
            q_b=kernel_parts(a.q_b_proj if a.q_lora else a.q_proj, False),
            kv_a=kernel_parts(a.kv_a_proj, False),
            kv_a_norm=a.kv_a_norm,
            k_b=a.k_b,
            v_b=a.v_b,
            rope_dim=a.rope_dim,
            scale=a.scale,
            o=kernel_parts(a.o_proj, False),
            post_norm=dl.post_attention_layernorm,
            # int8 allowed: as DeepseekLayer.forward_native and DeepseekMoe._add_shared
            gate_up=[] if moe else kernel_parts(dl.gate_up_proj, True),
            down=[] if moe else kernel_parts(dl.down_proj, True),
            experts=None if experts is None else experts.handle(),
            router=None if moe is None else moe.router,
            router_bias=None if moe is None else moe.router_bias,
            sigmoid=moe is not None and moe.sigmoid,
            groups=1 if pick is None else pick.groups,
            groups_used=1 if pick is None else pick.groups_used,
            top_k=0 if pick is None else pick.top_k,
            renormalise=pick is not None and pick.renormalise,
            route_scale=1.0 if pick is None else pick.scale,
            shared_gate_up=[] if shared is None else kernel_parts(shared.gate_up_proj, True),
            shared_down=[] if shared is None else kernel_parts(shared.down_proj, True),
        )

    def _add_moe_block(self, block: Any, experts: Any) -> None:
        """Nemotron 3's MoE block (``MoeBlock.forward_fused``'s weights; int8 allowed
        where ``relu_squared_mlp`` allows it, the latent projections on 16 bits as
        ``linear``'s default)."""
        pick = block.pick
        latent = block.latent_down is not None
        self.native.add_moe_block(
            in_norm=block.input_layernorm,
            experts=experts.handle(),
            router=block.router,
            router_bias=block.router_bias,
            groups=pick.groups,
            groups_used=pick.groups_used,
            top_k=pick.top_k,
            renormalise=pick.renormalise,
            route_scale=pick.scale,
            latent_down=kernel_parts(block.latent_down, False) if latent else [],
            latent_up=kernel_parts(block.latent_up, False) if latent else [],
            shared_up=kernel_parts(block.shared.up_proj, True),
            shared_down=kernel_parts(block.shared.down_proj, True),
        )

    def _add_gemma4(self, gl: Gemma4Layer, index: int, ffn: int, experts: Any) -> None:
        """A Gemma 4 layer (``Gemma4Layer.forward``'s weights), at its own shape; its
        rope table 1 (local) or 0 (global), as ``Gemma4Model.forward`` hands them; its
        experts beside the MLP (``Gemma4Moe``, native: ``_gemma4_why_not``), if any."""
        pl = gl.per_layer > 0
        self.native.add_gemma4_layer(
            in_norm=gl.input_layernorm,
            qkv=kernel_parts(gl.qkv_proj, False),
            q_norm=gl.q_norm,
            k_norm=gl.k_norm if gl.owns_kv else None,
            kv_heads=gl.num_kv_heads,
            head_dim=gl.head_dim,
            owns_kv=gl.owns_kv,
            rope=1 if gl.local_rope else 0,
            window=gl.window,
            o=kernel_parts(gl.o_proj, False),
            attn_out_norm=gl.attn_out_norm,
            post_norm=gl.post_attention_layernorm,
            gate_up=kernel_parts(gl.gate_up_proj, True),  # int8 allowed, as Gemma4Layer.forward
            ffn=ffn,
            down=kernel_parts(gl.down_proj, True),
            mlp_out_norm=gl.mlp_out_norm,
            per_layer_gate=_parts_or_float(gl.per_layer_gate) if pl else None,
            per_layer_proj=_parts_or_float(gl.per_layer_proj) if pl else None,
            per_layer_norm=gl.per_layer_norm if pl else None,
            per_layer_index=index,
            scalar=float(gl.layer_scalar),
        )
        moe = gl.moe
        if moe is not None:

            def f32(t: Tensor) -> Tensor:
                return t.float().contiguous()

            self.native.set_gemma4_experts(
                index,
                experts.handle(),
                f32(moe.router),
                moe.top_k,
                f32(moe.router_scale),
                f32(moe.per_expert_scale),
                f32(gl.dense_out_norm),
                f32(gl.experts_in_norm),
                f32(gl.experts_out_norm),
            )

    def _add_recurrent(self, layer: RecurrentLayer) -> None:
        """A hybrid model's recurrent layer: LFM2's short convolution (``lfm2.ShortConv``),
        Qwen3.5's Gated DeltaNet (``deltanet.GatedDeltaNet``) or Granite 4's Mamba-2
        (``mamba2.Mamba2``)."""
        from structllm.model.deltanet import GatedDeltaNet
        from structllm.model.mamba2 import Mamba2

        mixer: Any = layer.mixer
        if isinstance(mixer, GatedDeltaNet):
            self._add_delta(layer, mixer)
            return
        if isinstance(mixer, Mamba2):
            self._add_mamba(layer, mixer)
            return
        self.native.add_conv_layer(
            in_norm=layer.input_layernorm,
            in_proj=kernel_parts(mixer.in_proj, False),
            in_bias=_vector(mixer.in_bias),
            conv=mixer.conv.contiguous(),
            conv_bias=_vector(mixer.conv_bias),
            out_proj=kernel_parts(mixer.out_proj, False),
            out_bias=_vector(mixer.out_bias),
            post_norm=layer.post_attention_layernorm,
            **_mlp(layer),
        )

    def _add_delta(self, layer: RecurrentLayer, mixer: Any) -> None:
        """A Gated DeltaNet layer: its projections, filter, decay and gated norm's
        parameters (float32, contiguous: what ``GatedDeltaNet._native_rule`` passes)."""

        def f32(t: Tensor) -> Tensor:
            return t.float().contiguous()

        self.native.add_delta_layer(
            in_norm=layer.input_layernorm,
            qkv=kernel_parts(mixer.in_proj_qkv, False),
            z=kernel_parts(mixer.in_proj_z, False),
            b=kernel_parts(mixer.in_proj_b, False),
            a=kernel_parts(mixer.in_proj_a, False),
            conv=f32(mixer.conv1d),
            a_log=f32(mixer.A_log),
            dt_bias=f32(mixer.dt_bias),
            norm=f32(mixer.norm),
            out_proj=kernel_parts(mixer.out_proj, False),
            key_heads=mixer.num_k_heads,
            key_dim=mixer.head_k_dim,
            value_dim=mixer.head_v_dim,
            tiled=mixer.tiled_values,
            post_norm=layer.post_attention_layernorm,
            **_mlp(layer),
        )

    def _add_mamba(self, layer: Any, mixer: Any, mlp: bool = True) -> None:
        """A Mamba-2 layer: its projections, filter, time-step, decay, skip and gated
        norm's parameters (float32, contiguous: what ``Mamba2._native_scan`` passes),
        then its MLP (a ``RecurrentLayer``'s) or none (``mlp`` False: Nemotron-H's
        ``MambaBlock``)."""

        def f32(t: Tensor) -> Tensor:
            return t.float().contiguous()

        lo, hi = mixer.dt_limit
        self.native.add_mamba_layer(
            in_norm=layer.input_layernorm,
            in_proj=kernel_parts(mixer.in_proj, False),
            in_bias=_vector(mixer.in_bias),
            conv=f32(mixer.conv1d),
            conv_bias=_vector(mixer.conv_bias),
            dt_bias=f32(mixer.dt_bias),
            a_log=f32(mixer.A_log),
            d=f32(mixer.D),
            norm=f32(mixer.norm),
            out_proj=kernel_parts(mixer.out_proj, False),
            out_bias=_vector(mixer.out_bias),
            heads=mixer.num_heads,
            head_dim=mixer.head_dim,
            groups=mixer.n_groups,
            d_state=mixer.d_state,
            dt_lo=lo,
            dt_hi=hi,
            post_norm=layer.post_attention_layernorm if mlp else None,
            **(_mlp(layer) if mlp else _NO_MLP),
        )

    @staticmethod
    def takes(rows: LoraRows) -> bool:
        """Whether a decode step with adapter rows ``rows`` can run here: its adapters on
        the CPU's native kernels (else the Python loop adds them, with torch's ops)."""
        return rows.native is not None and rows.stacked is None

    def lora_items(self, rows: LoraRows) -> Any:
        """The native ``LoraItems`` of ``rows``' adapters in their groups' order, built
        on the first step with that set (kept in ``rows.plans``, which the registry keeps
        across such steps)."""
        items = rows.plans.decode
        if items is None:
            items = self.module.LoraItems(len(self.layers), *self.widths)
            for g, (adapter, _) in enumerate(rows.groups):
                for layer, parts in adapter.layers.items():
                    for p, proj in enumerate(PROJECTIONS):
                        for at, bt, col in parts.get(proj, ()):
                            items.add(layer, p, at, bt, col, g)
            rows.plans.decode = items
        return items

    def run(
        self,
        x: Tensor,
        pairs: list[Tensor],
        kv_caches: list[tuple[Tensor, ...]],
        meta: AttentionMetadata,
        between_layers: Callable[[], None] | None,
        lora: LoraRows | None = None,
        states: tuple[Tensor, Tensor] | None = None,
        per_layer: Tensor | None = None,
    ) -> Tensor:
        """The layers of a decode-only step: ``x [T, hidden]`` takes the residual
        additions in place; returns the last layer's output (``forward_fused``'s delta).
        ``pairs``: the rotary tables ``[T, D/2, 2]`` (global, local if any, identity if
        a layer does not rotate), as ``LlamaModel.forward`` makes them. ``between_layers`` runs
        between groups of ``check_every`` layers (``segments``), as in ``LlamaModel.forward``.
        ``lora``: the step's adapter rows (``takes`` them), or None. ``states``: a hybrid
        model's rows' state slots ``[T]`` int64 and fresh flags ``[T]`` bool, or None.
        ``per_layer``: Gemma 4's per-layer inputs ``[T, L, P]`` float32, or None."""
        if kv_caches is not self._caches:
            self.native.set_caches(kv_caches)
            self._caches = kv_caches
        t = x.shape[0]
        modes = (block_mode(t, True), block_mode(t, False))
        slots, tables, lens = meta.slot_mapping, meta.block_tables, meta.seq_lens
        adapters: tuple[Any, Tensor | None, list[int]] = (None, None, [])
        if lora is not None:
            adapters = (self.lora_items(lora), lora.rows, lora.starts)
        rows: dict[str, Tensor] = {}
        if states is not None:
            rows = {"state_slots": states[0], "fresh": states[1]}
        if per_layer is not None:
            rows["per_layer"] = per_layer
        delta: Tensor | None = None
        if between_layers is None:
            for begin, end, cut in self.unchecked:
                delta = self.native.run(
                    begin, end, x, delta, pairs, slots, tables, lens, *modes, *adapters, **rows
                )
                if cut:  # delta is that layer's MLP input
                    delta = self._experts(self.layers[end - 1], delta)
            assert delta is not None
            return delta
        for begin, end, check in self.segments:
            if check:
                between_layers()
            delta = self.native.run(
                begin, end, x, delta, pairs, slots, tables, lens, *modes, *adapters, **rows
            )
            if self.cut(end - 1):  # delta is that layer's MLP input
                delta = self._experts(self.layers[end - 1], delta)
        assert delta is not None
        return delta

    def _experts(self, dl: DecoderLayer | RecurrentLayer, h: Tensor) -> Tensor:
        """A mixture-of-experts layer's MLP on its input ``h [T, hidden]``, as
        ``forward_fused`` runs it: the experts, then the output norm and multiplier."""
        assert dl.moe is not None
        ops = self.ops
        out = dl.moe(h, dl.act, ops.gelu_tanh_mul if dl.act == "gelu_tanh" else ops.silu_mul)
        if isinstance(dl, RecurrentLayer):
            return out if dl.residual_scale == 1.0 else out * dl.residual_scale
        if not dl._plain_out or dl.mlp_out_norm is not None:
            out = dl._fused_out(ops, out, None, dl.mlp_out_norm)
        return out


def _parts_or_float(w: object) -> list[tuple[Tensor, int, bool]] | Tensor:
    """``kernel_parts(w, False)`` (blocks, or an F16 file's float16 rows), or a float
    matrix as float32 (``_gemma4_why_not`` lets the per-layer input projections be float:
    under a block wide, a file keeps them in F32 or F16; float32 ones stay so, and with
    ``--dtype float16`` they are fbgemm's ``HalfWeight``, whose weights are unpacked here)."""
    parts = kernel_parts(w, False)
    if parts is not None:
        return parts
    if isinstance(w, HalfWeight):
        return cast(Tensor, torch.ops.quantized.linear_unpack_fp16(w.packed)[0]).contiguous()
    return cast(Tensor, w).float().contiguous()


def _is_float(w: object) -> bool:
    return isinstance(w, HalfWeight) or (
        isinstance(w, Tensor) and w.is_floating_point() and w.dim() == 2
    )


def _mlp(layer: RecurrentLayer) -> dict[str, Any]:
    """A recurrent layer's MLP as the native plan's add_*_layer take it: its matrices
    (int8 allowed, as ``RecurrentLayer.forward_fused``), or none where its MLP is experts
    (``moe``: ``set_experts`` gives them, or they run from Python)."""
    moe = layer.moe is not None
    return {
        "gate_up": [] if moe else kernel_parts(layer.gate_up_proj, True),
        "gelu": layer.act == "gelu_tanh",
        "down": [] if moe else kernel_parts(layer.down_proj, True),
        "residual_scale": layer.residual_scale,
        "moe": moe,
    }


_NO_MLP: dict[str, Any] = {"gate_up": [], "gelu": False, "down": [], "residual_scale": 1.0}


def _shared_parts(moe: Any) -> tuple[Any, Any, Tensor | None] | None:
    """A MoE layer's shared expert as ``set_shared`` takes it (gate_up's and down's
    parts, int8 allowed as ``SparseMoe._add_shared``; its gate float32 ``[1, hidden]`` or
    None), or None: not in GGUF blocks, or a gate in another dtype."""
    shared, gate = moe.shared, moe.shared_gate
    parts = kernel_parts(shared.gate_up_proj, True), kernel_parts(shared.down_proj, True)
    if parts[0] is None or parts[1] is None:
        return None
    if gate is not None and (gate.dtype != torch.float32 or gate.dim() != 2):
        return None
    return parts[0], parts[1], None if gate is None else gate.contiguous()


def _vector(b: Tensor | None) -> Tensor | None:
    """A bias as the native plan takes it: float32, contiguous (None stays None)."""
    return None if b is None else b.float().contiguous()


def _native_experts(dl: DecoderLayer) -> Any:
    """The layer's ``cpu_moe.cpp`` ``Experts`` when the native call can run its MLP as
    ``SparseMoe.forward`` would on the fused path (SiLU or gpt-oss's activation, a float32
    router routed by ``cpu_moe.cpp``, native experts), else None."""
    moe = getattr(dl, "moe", None)  # (Nemotron-H's Mamba and MLP blocks have none)
    if moe is None or not moe.native_act(dl.act) or moe.router.dtype != torch.float32:
        return None
    if moe.native_route() is None:  # a family's own routing (GLM-4.5's)
        return None
    if moe.shared is not None and _shared_parts(moe) is None:  # (SparseMoe.forward adds it: a cut)
        return None
    if not moe.router.is_contiguous():
        return None
    return moe.native_experts()
