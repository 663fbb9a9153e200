"""Layers shared by the model families: rotary embeddings (plain, linear, Llama 3,
YaRN, LongRoPE, GGUF frequency factors; partial), the gated MLP's activations,
soft-capping, LayerNorm beside RMSNorm (``norm``), the mixture-of-experts MLP
(``SparseMoe``: router and experts, run grouped by expert).

Norms are torch's ``F.rms_norm`` throughout: Gemma's ``(1 + w)`` RMSNorm is the plain
one with ``1 + w`` stored as its weight (the loader adds the 1, as llama.cpp's
converter does), which rounds the same, since transformers computes ``1 + w`` in
float32 too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels import packed
from structllm.kernels.packed import BlockWeight, Weight, linear
from structllm.model.config import ROPE_TYPES, ModelConfig
from structllm.model.sharding import ShardPlan


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None, long: bool = False) -> Tensor:
    """Inverse frequencies ``[D/2]`` (float64) of each rotated pair, with the config's
    scaling (linear, Llama 3, YaRN, LongRoPE's short or ``long`` factors, a GGUF file's
    ``rope_freqs`` factors). Partial rotary: the pairs past ``rope_dim / 2`` get 0, a
    rotation by nothing (cos 1, sin 0), so every head's pairs go through one table and
    the rotation leaves them exactly as they are. ``theta``: another base (Gemma 3's local
    layers, which are never scaled)."""
    d = cfg.rope_dim
    base = cfg.rope_theta if theta is None else theta
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = (cfg.rope_scaling or {}) if theta is None else {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        factor, lo, hi = (
            float(sc["factor"]),
            float(sc["low_freq_factor"]),
            float(sc["high_freq_factor"]),
        )
        old_ctx = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "yarn":
        inv = _yarn_inv_freq(cfg, sc, inv, base)
    elif kind == "freq_factors":  # llama.cpp's rope_freqs: each pair's angle divided by it
        inv = inv / torch.tensor(sc["factors"], dtype=torch.float64)[: d // 2]
    elif kind == "proportional":  # Gemma 4: the first pairs rotate, the rest by nothing
        angles = int(float(sc.get("partial_rotary_factor", 1.0)) * cfg.head_dim // 2)
        inv[angles:] = 0.0
        inv = inv / float(sc.get("factor", 1.0))
    elif kind == "longrope":
        ext = torch.tensor(sc["long_factor" if long else "short_factor"], dtype=torch.float64)
        inv = inv / ext
    elif kind not in ("default", None):
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; expected one of {sorted(ROPE_TYPES)}"
        )
    return F.pad(inv, (0, (cfg.head_dim - d) // 2))


def _yarn_inv_freq(cfg: ModelConfig, sc: dict[str, Any], inv: Tensor, base: float) -> Tensor:
    """YaRN's frequencies ``[d/2]``: the fast-rotating pairs (more than ``beta_fast``
    turns over the original context) keep theirs, the slow ones (under ``beta_slow``)
    are interpolated by ``factor``, with a linear ramp over the pairs between."""
    d = cfg.rope_dim
    orig = float(sc.get("original_max_position_embeddings") or cfg.max_position_embeddings)

    def pair_of(turns: float) -> float:  # the pair index that turns this often in orig
        return d * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_of(float(sc.get("beta_fast") or 32)), pair_of(float(sc.get("beta_slow") or 1))
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = (torch.arange(d // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)
    keep = (1 - ramp.clamp(0, 1)) * float(sc.get("extrapolation_factor", 1.0))
    return inv / yarn_factor(cfg) * (1 - keep) + inv * keep


def yarn_factor(cfg: ModelConfig) -> float:
    """YaRN's context factor (its config's, else the ratio of the two context lengths)."""
    sc = cfg.rope_scaling or {}
    if sc.get("factor") is not None:
        return float(sc["factor"])
    return cfg.max_position_embeddings / float(sc["original_max_position_embeddings"])


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The scale of cos and sin: LongRoPE's and YaRN's (1 otherwise)."""
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type")
    if kind not in ("longrope", "yarn"):
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    if kind == "yarn":  # 0.1 ln(s) + 1, the paper's (eq. 21), or its ratio with mscales
        factor = yarn_factor(cfg)

        def mscale(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        ms, ms_all = sc.get("mscale"), sc.get("mscale_all_dim")
        return mscale(float(ms)) / mscale(float(ms_all)) if ms and ms_all else mscale(1.0)
    orig = float(sc["original_max_position_embeddings"])
    factor = float(sc.get("factor") or sc.get("max_position_embeddings", orig) / orig)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def rope_rows(cfg: ModelConfig, start: int, stop: int, theta: float | None = None) -> Tensor:
    """Rotations ``exp(i * pos * inv_freq)`` of positions ``start..stop-1``,
    ``[stop - start, D/2]`` complex64. LongRoPE: positions before the original context
    rotate by the short factors, later ones by the long factors (transformers switches a
    whole sequence once it passes that length, which a KV cache of rotated keys cannot
    follow; within it the two agree), both scaled by the attention factor."""
    pos = torch.arange(start, stop, dtype=torch.float64)
    sc = (cfg.rope_scaling or {}) if theta is None else {}
    mag = rope_attention_factor(cfg) if theta is None else 1.0
    if sc.get("rope_type") == "longrope":
        orig = int(sc["original_max_position_embeddings"])
        short = torch.outer(pos, rope_inv_freq(cfg))
        long = torch.outer(pos, rope_inv_freq(cfg, long=True))
        angles = torch.where((pos >= orig)[:, None], long, short)
    else:
        angles = torch.outer(pos, rope_inv_freq(cfg, theta))
    mags = torch.ones_like(angles)
    mags[:, : cfg.rope_dim // 2] = mag  # pairs past a partial rotary stay as they are
    return torch.polar(mags, angles).to(torch.complex64)


def mrope_rotations(
    table: Tensor, positions: Tensor, section: list[int], interleaved: bool = False
) -> Tensor:
    """M-RoPE's rotations ``[T, D/2]`` (complex64) of ``positions: [3, T]`` (t, h, w) from
    ``table`` (``rope_rows``): rotary pair ``j`` turns by its axis's position
    (``mrope_axes``); pairs past the rotary ones (a partial rotary's identity) by t."""
    if not section:
        raise ValueError("3-D positions for a model without mrope_section")
    rows = table[positions]  # [3, T, D/2]
    axes = mrope_axes(section, rows.shape[-1], interleaved).to(rows.device)  # [D/2]
    return rows.gather(0, axes.view(1, 1, -1).expand(1, rows.shape[1], -1))[0]


def mrope_axes(section: list[int], pairs: int, interleaved: bool) -> Tensor:
    """The position axis (0 t, 1 h, 2 w) of each of ``pairs`` rotary pairs: the first
    ``section[0]`` by t, the next ``section[1]`` by h, then w (transformers'
    ``mrope_section`` split, Qwen2.5-VL's), or, ``interleaved`` (Qwen3-VL's), pair ``j``
    h's when ``j % 3 == 1`` and ``j < 3 * section[1]``, w's when ``j % 3 == 2`` and ``j <
    3 * section[2]``, t's otherwise; pairs past the section t's."""
    axes = torch.zeros(pairs, dtype=torch.long)
    if interleaved:
        for axis in (1, 2):
            axes[axis : min(3 * section[axis], pairs) : 3] = axis
        return axes
    t, h, w = section
    axes[t : t + h] = 1
    axes[t + h : t + h + w] = 2
    return axes


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate interleaved pairs of ``x: [T, n, D]`` by ``rope: [T, 1, D/2]`` (complex64).
    Rotation runs in float32 whatever the model's dtype (torch has no bf16 complex)."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # [T, n, D/2]
    return torch.view_as_real(xc * rope).flatten(-2).to(x.dtype)


def activation(x: Tensor, act: str) -> Tensor:
    """``act(x)`` (``config.MLP_ACTS``): SiLU, GELU with the tanh approximation
    (transformers' gelu_new / gelu_pytorch_tanh), exact GELU, or relu squared."""
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "gelu":
        return F.gelu(x)
    if act == "relu2":
        return F.relu(x).square()
    return F.silu(x)


def gated_act(gate: Tensor, up: Tensor, act: str) -> Tensor:
    """``act(gate) * up`` (in place in ``gate``'s result): SiLU, or GELU with the tanh
    approximation (Gemma's GeGLU), or another of ``activation``'s."""
    return activation(gate, act).mul_(up)


def norm(x: Tensor, w: Tensor, b: Tensor | None, eps: float, kind: str) -> Tensor:
    """``x [..., D]`` through the family's norm: RMSNorm (``kind`` "rms"), or LayerNorm
    with ``b`` its bias (None: without one, Cohere's); ``w [D]``."""
    if kind == "layer":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def soft_cap(x: Tensor, cap: float) -> Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's logits), or ``x`` when ``cap`` is 0."""
    if not cap:
        return x
    return torch.tanh(x / cap) * cap


def interleave_rope_rows(w: Tensor, num_heads: int, rope_dim: int | None = None) -> Tensor:
    """Rows of a q/k projection from "halves" to "interleaved" rotary layout (see
    ``model.llama``): per head, ``[x0..x_{R/2-1}, x_{R/2}..x_{R-1}, rest]`` ->
    ``[x0, x_{R/2}, x1, ..., rest]`` with ``R = rope_dim`` (default: the whole head).
    Works for weights ``[H*D, in]`` and biases or norm weights ``[H*D]``."""
    rest = w.shape[1:]
    heads = w.reshape(num_heads, -1, *rest)
    d = heads.shape[1]
    r = rope_dim or d
    rot = (
        heads[:, :r]
        .reshape(num_heads, 2, r // 2, *rest)
        .transpose(1, 2)
        .reshape(num_heads, r, *rest)
    )
    if r == d:
        return rot.reshape(w.shape)
    return torch.cat([rot, heads[:, r:]], dim=1).reshape(w.shape)


class Expert(nn.Module):
    PACKED = ("gate_up_proj", "down_proj")  # matmul weights, for LlamaModel.pack_weights
    gate_up_proj: Weight  # [2F, hidden], gate rows then up rows
    down_proj: Weight  # [hidden, F]

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(2 * ffn, hidden, dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(torch.empty(hidden, ffn, dtype=dtype), requires_grad=False)


class SparseMoe(nn.Module):
    """The router (``router: [E, hidden]``) and the experts of one layer; with ``plan``,
    every expert's slice of its intermediate dimension (the output is then this rank's
    partial sum, completed by the layer's all-reduce). With
    ``cfg.shared_expert_intermediate_size`` (Qwen2-MoE), a shared expert (``shared``, a
    gated MLP every token runs) whose output, scaled by ``sigmoid(shared_gate . h)``
    (``shared_gate: [1, hidden]``), is added to the routed experts' (a per-token scale,
    so with ``plan`` its partial sum is the rank's share too)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None = None) -> None:
        super().__init__()
        ffn = len(plan.expert_ffn) if plan else cfg.moe_intermediate_size or cfg.intermediate_size
        self.top_k, self.renormalise = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = nn.Parameter(
            torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype), requires_grad=False
        )
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, ffn, dtype) for _ in range(cfg.num_experts)
        )
        self.hidden, self.ffn = cfg.hidden_size, ffn
        self.native: Any = None  # cpu_moe.cpp's Experts, once built (False: not for these weights)
        self.shared: Expert | None = None
        self.shared_gate: nn.Parameter | None = None
        if cfg.shared_expert_intermediate_size:
            width = len(plan.shared_ffn) if plan else cfg.shared_expert_intermediate_size
            self.shared = Expert(cfg.hidden_size, width, dtype)
            self.shared_gate = nn.Parameter(
                torch.empty(1, cfg.hidden_size, dtype=dtype), requires_grad=False
            )

    def forward(
        self,
        h: Tensor,
        act: str,
        fused_act: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """``h: [T, hidden]`` -> ``[T, hidden]``. ``fused_act``: the fused CPU op of
        ``act`` on ``[T, 2F]`` rows (else torch's ops)."""
        weights, chosen = self.route(h, fused=fused_act is not None)  # [T, k] each
        return self.run_experts(h, weights, chosen, act, fused_act)

    def run_experts(
        self,
        h: Tensor,
        weights: Tensor,
        chosen: Tensor,
        act: str,
        fused_act: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """``forward`` once routed: ``weights, chosen: [T, k]`` (a family with a router of
        its own, Gemma 4's, routes and calls this)."""
        return self._add_shared(h, self.routed(h, weights, chosen, act, fused_act), act, fused_act)

    def routed(
        self,
        h: Tensor,
        weights: Tensor,
        chosen: Tensor,
        act: str,
        fused_act: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """The routed experts' weighted sum ``[T, hidden]`` (``run_experts`` without the
        shared expert)."""
        if fused_act is not None and self.native_act(act) and h.dtype == torch.float32 and h.is_cpu:
            native = self.native_experts()
            if native is not None:  # one native call for every expert (cpu_moe.cpp)
                return cast(Tensor, native.forward(h, chosen, weights))
        weights = weights.to(h.dtype).flatten()  # [T * k]
        # (token, choice) slots sorted by expert; each expert's run of slots at once
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(h)
        start = 0
        for e, n in enumerate(counts):  # experts in order, as transformers adds them
            if n == 0:
                continue
            slots = order[start : start + n]
            start += n
            rows = slots // self.top_k  # the tokens (distinct: a token picks an expert once)
            y = self.expert_mlp(cast(Expert, self.experts[e]), h[rows], act, fused_act)

            # index_put_ (accumulate; rows are distinct, so each gets one addition, as
            # index_add_ gives): CPU index_add_ opens a parallel region per call, which
            # stalls whenever a pool thread is descheduled (median 8 us, mean 15 ms on 2
            # busy cores); index_put_ here runs inline (mean 9 us)
            out.index_put_((rows,), y * weights[slots, None], accumulate=True)
        return out

    def native_act(self, act: str) -> bool:
        """Whether the native expert call runs this activation (SiLU; gpt-oss's own)."""
        return act == "silu"

    def native_route(self) -> tuple[Tensor | None, bool] | None:
        """How ``cpu_moe.cpp``'s router runs this layer's ``route`` on the fused path, for
        the native decode loop: (bias ``[E]`` float32 or None, softmax over the chosen
        logits), or None where a family routes in its own way (GLM-4.5's)."""
        return (None, False) if type(self).route is SparseMoe.route else None

    def native_extras(self) -> dict[str, Any]:
        """What ``cpu_moe.cpp``'s ``Experts`` takes beyond the matrices: none here (biases
        and another activation: ``model.gpt_oss``)."""
        return {}

    def expert_mlp(
        self,
        expert: Expert,
        x: Tensor,
        act: str,
        fused_act: Callable[[Tensor], Tensor] | None,
    ) -> Tensor:
        """One expert's gated MLP of its tokens' rows ``x: [n, hidden]`` -> ``[n, hidden]``
        (gpt-oss's experts differ: ``model.gpt_oss``)."""
        gate_up = linear(x, expert.gate_up_proj, int8_ok=True)  # [n, 2F]
        if fused_act is not None:
            mid = fused_act(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            mid = gated_act(gate, up, act)
        return linear(mid, expert.down_proj, int8_ok=True)

    def _add_shared(
        self,
        h: Tensor,
        out: Tensor,
        act: str,
        fused_act: Callable[[Tensor], Tensor] | None,
    ) -> Tensor:
        """``out`` (the routed experts' sum) plus the shared expert's output, if the
        layer has one: gated (transformers' order: the shared output scaled, then added),
        or as it is where the layer has no ``shared_gate`` (GLM-4.5's)."""
        if self.shared is None:
            return out
        gate_up = linear(h, self.shared.gate_up_proj, int8_ok=True)  # [T, 2S]
        if fused_act is not None:
            mid = fused_act(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            mid = gated_act(gate, up, act)
        y = linear(mid, self.shared.down_proj, int8_ok=True)  # [T, hidden]
        if self.shared_gate is None:
            return out + y
        return out + torch.sigmoid(F.linear(h, self.shared_gate)) * y

    def route(self, h: Tensor, fused: bool) -> tuple[Tensor, Tensor]:
        """The router's top k of ``h: [T, hidden]``: (weights, chosen), ``[T, k]`` each.
        On the fused CPU path (float32) by ``cpu_moe.cpp``'s ``route`` (torch's three
        small ops were one OpenMP region each, which on shared cores waited for a
        descheduled thread); both expert paths route alike, so they stay equal."""
        if fused and h.dtype == torch.float32 and h.is_cpu and self.router.dtype == torch.float32:
            from structllm.kernels import cpu_ext

            module = cpu_ext.load_moe()
            if module is not None:
                w, c = module.route(h, self.router, self.top_k, self.renormalise)
                return cast(Tensor, w), cast(Tensor, c)
        probs = F.linear(h, self.router).softmax(-1, dtype=torch.float32)  # [T, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, chosen

    def half_experts(self, half: str) -> None:
        """Before ``pack_weights``: the experts' matrices that it would run as float16
        (``half``: ``"all"``, or ``"file"`` for float16 ones) as ``HalfMatrix`` instead of
        fbgemm's ``HalfWeight``, so the native call runs them (``native_experts``) and the
        per-expert loop the same kernel; a matrix the kernel cannot take is left to
        ``pack_weights``."""
        for expert in self.experts:
            for name in Expert.PACKED:
                w = getattr(expert, name)
                if isinstance(w, BlockWeight) or not isinstance(w, Tensor):
                    continue
                if half != "all" and not (half == "file" and w.dtype == torch.float16):
                    continue
                h = packed.half_matrix(w)
                if h is not None:
                    del expert._parameters[name]
                    setattr(expert, name, h)

    def native_experts(self) -> Any:
        """cpu_moe.cpp's ``Experts`` over this layer's block or float16 weights (built on
        first use, after loading has packed them), or None: some expert is neither
        (float32 stays on torch's exact ops) or the kernel is missing."""
        if self.native is None:
            self.native = native_experts_of(
                [cast(Expert, e) for e in self.experts], self.hidden, self.ffn, self.native_extras()
            )
        return self.native or None


def native_experts_of(
    experts: list[Any], hidden: int, ffn: int, extras: dict[str, Any], first: str = "gate_up_proj"
) -> Any:
    """``Experts`` for these experts, or False (see ``SparseMoe.native_experts``);
    ``extras``: ``SparseMoe.native_extras``; ``first``: the name of each expert's first
    matrix (Nemotron 3's relu² experts: ``up_proj``, with ``act`` 3)."""
    gate_up = [packed.kernel_parts(getattr(e, first), True) for e in experts]
    down = [packed.kernel_parts(e.down_proj, True) for e in experts]
    if any(p is None for p in gate_up + down):
        return False
    from structllm.kernels import cpu_ext

    module = cpu_ext.load_moe()
    if module is None:
        return False
    return module.Experts(
        gate_up,
        down,
        hidden,
        ffn,
        packed.int8_min_m(),
        packed.int16_min_m(),
        module.kernel_table,
        **extras,
    )
