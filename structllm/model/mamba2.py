"""The Mamba-2 mixer (transformers' ``GraniteMoeHybridMambaLayer``, the same layer as
``Mamba2Mixer``), over the per-slot states of ``recurrent``.

Per head ``h`` (``H`` heads of ``P`` channels), the layer keeps a state ``S [P, N]``.
With ``dt_t = softplus(dt_raw_t + dt_bias) > 0`` and ``A = -exp(A_log) < 0`` (a scalar
per head), token ``t`` does

    S   <- exp(dt_t A) S + dt_t x_t B_t^T      (decay, then write x_t along B_t)
    y_t  = S C_t + D x_t                        (read along C_t, plus a skip)

(``x_t [P]`` the head's channels, ``B_t, C_t [N]`` its group's: ``G`` groups, each
shared by ``H / G`` consecutive heads, transformers' ``repeat_interleave``). Before it,
a depthwise causal convolution (SiLU after) over ``[x, B, C]``; after it, the output
gated by ``silu(z)`` and RMS-normalised per group of ``H P / G`` channels (transformers'
``GraniteMoeHybridRMSNormGated``), then ``out_proj``.

Through torch's ops (``ssd``: the exact float32 path and the reference), prefill chunks
run the chunked SSD form (``_ssd_chunked``, transformers' ``mamba2_chunk_scan``), one
sequence at a time from its slot's state, and decode rows the recurrence above as one
batched update over all decoding slots. Through the native kernels
(``Mamba2._native_scan``), both run the recurrence token by token (``cpu_recurrent.cpp``'s
``ssm_decode`` and ``ssm_prefill``).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.packed import Weight, linear
from structllm.model.config import ModelConfig
from structllm.model.recurrent import RecurrentBatch, causal_conv1d, take_layer


def segment_sum(a: Tensor) -> Tensor:
    """``a [..., C]`` -> ``[..., C, C]``: ``out[i, j] = a[j+1] + ... + a[i]`` for
    ``j <= i`` (0 on the diagonal), ``-inf`` above it. Summed from masked copies (not as
    a difference of cumulative sums, which loses the small sums next to large ones), as
    transformers' ``segment_sum``."""
    c = a.shape[-1]
    x = a[..., None].expand(*a.shape, c)  # [..., C, C]: x[i, j] = a[i]
    strict = torch.ones(c, c, dtype=torch.bool, device=a.device).tril(-1)
    x = x.masked_fill(~strict, 0).cumsum(-2)
    lower = torch.ones(c, c, dtype=torch.bool, device=a.device).tril()
    return x.masked_fill(~lower, float("-inf"))


def _ssd_chunked(
    x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, s0: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """One sequence's rows by the chunked (state space duality) form, without the ``D``
    skip. ``x: [L, H, P]``, ``dt: [L, H]`` (after softplus), ``a: [H]`` (``A < 0``),
    ``b, c: [L, H, N]`` (already expanded from groups to heads), ``s0: [H, P, N]`` the
    state before row 0 -> ``(y [L, H, P], final state [H, P, N])``, all float32.

    Within a chunk starting from state ``S0``, with ``q_t = dt_1 A + ... + dt_t A`` (the
    log decay from the chunk's start through row ``t``),

        y_t = sum_{s<=t} e^{q_t - q_s} (C_t . B_s) dt_s x_s  +  e^{q_t} S0 C_t

    (a causal "attention" inside the chunk plus a read of ``S0``), and the chunk ends in
    ``e^{q_C} S0 + sum_s e^{q_C - q_s} dt_s x_s B_s^T``. Everything but the pass of
    states from chunk to chunk runs for every chunk at once. Padding rows (``dt = 0``)
    neither decay nor write.
    """
    n, h, p = x.shape
    size = min(chunk, n)  # a short sequence is one chunk of its own length, unpadded
    pad = -n % size
    xdt = x * dt[..., None]  # [L, H, P]
    ad = dt * a  # [L, H]: dt_t A
    if pad:
        xdt, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xdt, b, c))
        ad = F.pad(ad, (0, 0, 0, pad))
    m = (n + pad) // size  # chunks
    # heads first, then chunks: [H, M, C, D] and [H, M, C]
    xdt, b, c = (t.reshape(m, size, h, t.shape[-1]).permute(2, 0, 1, 3) for t in (xdt, b, c))
    ad = ad.reshape(m, size, h).permute(2, 0, 1)
    cum = ad.cumsum(-1)  # [H, M, C]: q_t
    decay = segment_sum(ad).exp()  # [H, M, C, C]: e^{q_t - q_s} for s <= t, else 0
    y = ((c @ b.transpose(-1, -2)) * decay) @ xdt  # [H, M, C, P]: within the chunk
    last = cum[..., -1:]  # [H, M, 1]
    # [H, M, P, N]: each chunk's own writes, decayed to its end
    writes = (xdt * (last - cum).exp()[..., None]).transpose(-1, -2) @ b
    chunk_decay = last.exp()[..., None]  # [H, M, 1, 1]
    starts = torch.empty(h, m, p, b.shape[-1], dtype=torch.float32, device=x.device)
    s = s0  # [H, P, N]
    for i in range(m):
        starts[:, i] = s
        s = s * chunk_decay[:, i] + writes[:, i]
    y = y + (c @ starts.transpose(-1, -2)) * cum.exp()[..., None]  # reads of S0
    return y.permute(1, 2, 0, 3).reshape(m * size, h, p)[:n], s


def ssd(
    x: Tensor,
    dt: Tensor,
    a: Tensor,
    b: Tensor,
    c: Tensor,
    d: Tensor,
    states: Tensor,
    rb: RecurrentBatch,
    chunk: int,
) -> Tensor:
    """The Mamba-2 scan over a step's rows (see the module's docstring).

    ``x: [T, H, P]``; ``dt: [T, H]`` the time steps (after ``dt_bias``, softplus and any
    clamp); ``a: [H]`` (``A = -exp(A_log)``); ``b, c: [T, G, N]`` (``H`` a multiple of
    ``G``); ``d: [H]`` the skip; ``states: [S, H, P, N]`` float32, one per slot, finite:
    the rows of ``rb``'s slots are read (taken as zero where ``fresh``) and replaced by
    their sequences' states after this step's rows; prefill chunks run the chunked form
    with ``chunk`` rows per chunk. Returns ``y: [T, H, P]`` float32. Math in float32
    whatever the inputs' dtype.
    """
    _, h, p = x.shape
    g = b.shape[1]
    if h % g:
        raise ValueError(f"{h} heads are not a multiple of {g} groups")
    x, dt, a, d = x.float(), dt.float(), a.float(), d.float()
    b = b.float().repeat_interleave(h // g, dim=1)  # [T, H, N]
    c = c.float().repeat_interleave(h // g, dim=1)  # [T, H, N]
    y = x * d[:, None]  # [T, H, P]: the skip
    nd = rb.num_decodes
    if nd:
        # S' = e^{dt A} S + dt x B^T, y = S' C: one batched update. A fresh sequence's
        # S is zero: its decay is zeroed (the slot's old values, finite, multiplied away)
        s = states[rb.slots[:nd]]  # [nd, H, P, N] (a copy)
        decay = (dt[:nd] * a).exp() * (~rb.fresh_mask[:nd])[:, None]  # [nd, H]
        s.mul_(decay[..., None, None])
        s.view(-1, p, s.shape[-1]).baddbmm_(
            (x[:nd] * dt[:nd, :, None]).reshape(-1, p, 1), b[:nd].reshape(-1, 1, b.shape[-1])
        )
        y[:nd] += (s @ c[:nd, :, :, None])[..., 0]
        states[rb.slots[:nd]] = s
    for first, end, slot, fresh in rb.prefills(states):
        s0 = states.new_zeros(states.shape[1:]) if fresh else states[slot]  # [H, P, N]
        sl = slice(first, end)
        out, s_end = _ssd_chunked(x[sl], dt[sl], a, b[sl], c[sl], s0, chunk)
        y[sl] += out
        states[slot] = s_end
    return y


def gated_group_rms_norm(y: Tensor, z: Tensor, weight: Tensor, groups: int, eps: float) -> Tensor:
    """transformers' ``GraniteMoeHybridRMSNormGated`` (``norm_before_gate=False``):
    ``y * silu(z)``, RMS-normalised over each of ``groups`` equal runs of the last
    dimension, times ``weight``; ``y, z: [T, I]``, in float32."""
    x = y.float() * F.silu(z.float())
    t, width = x.shape
    x = x.view(t, groups, width // groups)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * x.view(t, width)


# our parameter -> its tensor in a Hugging Face layer, under ``model.layers.{i}.mamba.``
HF_NAMES: dict[str, str] = {
    "in_proj": "in_proj.weight",
    "in_bias": "in_proj.bias",
    "conv1d": "conv1d.weight",
    "conv_bias": "conv1d.bias",
    "dt_bias": "dt_bias",
    "A_log": "A_log",
    "D": "D",
    "norm": "norm.weight",
    "out_proj": "out_proj.weight",
    "out_bias": "out_proj.bias",
}


def hf_names(prefix: str = "") -> dict[str, str]:
    """Our names -> the Hugging Face names, each after ``prefix`` (for example
    ``"model.layers.3.mamba."``)."""
    return {ours: prefix + theirs for ours, theirs in HF_NAMES.items()}


def from_hf(state: dict[str, Tensor], hf_prefix: str, prefix: str = "") -> dict[str, Tensor]:
    """Take (pop) one layer's ``mamba.*`` tensors from a Hugging Face ``state`` (their
    names after ``hf_prefix``, e.g. ``"model.layers.3.mamba."``) -> ours after
    ``prefix`` (e.g. ``"layers.3.mixer."``), the convolution's as ``[C, K]``; the biases
    where the checkpoint has them."""
    biases = frozenset(n for n in HF_NAMES if n.endswith("bias") and n != "dt_bias")
    return take_layer(state, HF_NAMES, hf_prefix, prefix, biases)


class Mamba2(nn.Module):
    """Granite 4's Mamba-2 layer (transformers' ``GraniteMoeHybridMambaLayer``).

    Parameters (our names; ``I = H P`` the inner width, ``C = I + 2 G N`` the
    convolution's channels): ``in_proj [I + C + H, hidden]`` (rows: the gate ``z``,
    ``x, B, C``, the time step), ``in_bias [I + C + H]`` (with ``proj_bias``), ``conv1d
    [C, K]``, ``conv_bias [C]`` (with ``conv_bias``), ``dt_bias [H]``, ``A_log [H]``,
    ``D [H]``, ``norm [I]`` (the gated norm's weight), ``out_proj [hidden, I]``,
    ``out_bias [hidden]`` (with ``proj_bias``). The matmul weights (``PACKED``) may be
    any ``packed.Weight``.

    States per slot (``state_shapes``): the convolution's ``[C, K - 1]`` and the
    scan's ``[H, P, N]``, both float32 (the runner's).
    """

    PACKED = ("in_proj", "out_proj")  # (LlamaModel.pack_weights packs the modules with PACKED)
    # False: torch's ops for the decode rows even where the native kernels are loaded (the
    # Python loop as it was before them: bench/hybrid_decode.py's --torch-scan)
    native_scan = True
    # False: the prefill rows through torch's chunked form (``_torch_scan``) even where
    # ``ssm_prefill`` is loaded, as before it (bench/hybrid_prefill.py's --ssm-chunked)
    native_prefill = True

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        d_state: int,
        conv_kernel: int,
        chunk_size: int,
        rms_norm_eps: float,
        conv_bias: bool = True,
        proj_bias: bool = False,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba_n_heads ({num_heads}) must be a multiple of mamba_n_groups")
        self.num_heads, self.head_dim, self.n_groups, self.d_state = (
            num_heads,
            head_dim,
            n_groups,
            d_state,
        )
        self.inner = num_heads * head_dim  # I
        self.conv_dim = self.inner + 2 * n_groups * d_state  # C
        self.kernel, self.chunk_size, self.eps = conv_kernel, chunk_size, rms_norm_eps
        self.dt_limit = dt_limit

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        proj = self.inner + self.conv_dim + num_heads
        self.in_proj: Weight = p(proj, hidden_size)
        self.in_bias: nn.Parameter | None = p(proj) if proj_bias else None
        self.conv1d = p(self.conv_dim, conv_kernel)  # [C, K]: oldest input first
        self.conv_bias: nn.Parameter | None = p(self.conv_dim) if conv_bias else None
        self.dt_bias = p(num_heads)
        self.A_log = p(num_heads)
        self.D = p(num_heads)
        self.norm = p(self.inner)
        self.out_proj: Weight = p(hidden_size, self.inner)
        self.out_bias: nn.Parameter | None = p(hidden_size) if proj_bias else None

    @classmethod
    def from_config(cls, cfg: Any, dtype: torch.dtype = torch.float32) -> Mamba2:
        """From transformers' ``GraniteMoeHybridConfig`` (or anything with its
        ``mamba_*`` names as attributes)."""
        limit = getattr(cfg, "time_step_limit", None) or (0.0, math.inf)
        return cls(
            cfg.hidden_size,
            cfg.mamba_n_heads,
            cfg.mamba_d_head,
            cfg.mamba_n_groups,
            cfg.mamba_d_state,
            cfg.mamba_d_conv,
            cfg.mamba_chunk_size,
            cfg.rms_norm_eps,
            bool(cfg.mamba_conv_bias),
            bool(cfg.mamba_proj_bias),
            (float(limit[0]), float(limit[1])),
            dtype,
        )

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> Mamba2:
        """From our ``ModelConfig``'s ``mamba_*`` sizes (Granite 4's, Nemotron-H's)."""
        return cls(
            cfg.hidden_size,
            cfg.mamba_heads,
            cfg.mamba_head_dim,
            cfg.mamba_groups,
            cfg.mamba_d_state,
            cfg.conv_kernel,
            cfg.mamba_chunk_size,
            cfg.rms_norm_eps,
            conv_bias=cfg.conv_bias,
            proj_bias=cfg.mamba_proj_bias,
            dtype=dtype,
        )

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((C, K - 1), (H, P, N))``: the convolution's and the scan's (``hybrid.Mixer``'s)."""
        return (self.conv_dim, self.kernel - 1), (self.num_heads, self.head_dim, self.d_state)

    def _native_scan(self, xbc: Tensor, dt: Tensor, states: Tensor, rb: RecurrentBatch) -> Tensor:
        """The scan through ``cpu_recurrent.cpp``: the decode rows by ``ssm_decode`` (the
        time step's softplus and clamp, the update, the read and the ``D`` skip in one
        pass over each slot's state; the native decode loop runs the same function), the
        prefill rows by ``ssm_prefill`` (the same recurrence token by token, one task per
        sequence and head, the state in cache throughout; the prefix cache's saved
        states as ``rb.segments()`` lays them out). ``xbc [T, C]`` (after the
        convolution), ``dt [T, H]`` raw (``in_proj``'s columns, unsliced rows: the
        kernels read them in place) -> ``y [T, I]`` float32."""
        nat, nd, t = rb.native, rb.num_decodes, xbc.shape[0]
        dt_bias, a_log = self.dt_bias.float().contiguous(), self.A_log.float().contiguous()
        d = self.D.float().contiguous()
        lo, hi = self.dt_limit
        dec = (xbc[:nd], dt[:nd], dt_bias, a_log, d, states, rb.slots[:nd], rb.fresh_mask[:nd])
        if nd == t:  # a decode-only step: the kernel's output is the whole y
            return cast(Tensor, nat.ssm_decode(*dec, self.n_groups, lo, hi))
        y = torch.empty(t, self.inner, dtype=torch.float32, device=xbc.device)
        if nd:
            y[:nd] = nat.ssm_decode(*dec, self.n_groups, lo, hi)
        if not self.native_prefill:
            y[nd:] = self._torch_scan(xbc[nd:], dt[nd:], states, rb.prefills_only())
            return y
        segs = rb.segments()  # rows nd.. of this step (row indices into xbc, dt and y)
        nat.ssm_prefill(xbc, dt, dt_bias, a_log, d, states, segs, self.n_groups, lo, hi, y)
        return y

    def _torch_scan(self, xbc: Tensor, dt: Tensor, states: Tensor, rb: RecurrentBatch) -> Tensor:
        """The scan through torch's ops (``ssd``: the recurrence for decode rows, the
        chunked form for prefill rows), the time step's softplus and clamp first. ``xbc
        [T, C]`` (after the convolution), ``dt [T, H]`` raw -> ``y [T, I]``."""
        t, h, p, gn = xbc.shape[0], self.num_heads, self.head_dim, self.n_groups * self.d_state
        xs, b, c = xbc.split([self.inner, gn, gn], dim=-1)
        step = F.softplus(dt.float() + self.dt_bias.float())  # [T, H]
        lo, hi = self.dt_limit
        if lo > 0.0 or hi != math.inf:
            step = step.clamp(lo, hi)
        y = ssd(
            xs.reshape(t, h, p),
            step,
            -self.A_log.float().exp(),
            b.reshape(t, self.n_groups, self.d_state),
            c.reshape(t, self.n_groups, self.d_state),
            self.D,
            states,
            rb,
            self.chunk_size,
        )  # [T, H, P]
        return y.reshape(t, self.inner)

    def forward(self, x: Tensor, states: tuple[Tensor, ...], rb: RecurrentBatch) -> Tensor:
        """``x: [T, hidden]`` (the step's rows as ``rb`` lays them out), ``states``: the
        convolution's ``[S, C, K - 1]`` and the scan's ``[S, H, P, N]`` float32 (both
        updated in place for ``rb``'s slots) -> ``[T, hidden]``."""
        conv_states, ssm_states = states
        proj = linear(x, self.in_proj, self.in_bias)  # [T, I + C + H]
        z, xbc, dt = proj.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        xbc = causal_conv1d(xbc, self.conv1d, self.conv_bias, conv_states, rb, silu=True)  # [T, C]
        if rb.native is not None and proj.dtype == torch.float32 and self.native_scan:
            y = self._native_scan(xbc, dt, ssm_states, rb)  # [T, I]
            y = rb.native.group_norm(y, z, self.norm.float().contiguous(), self.n_groups, self.eps)
            return linear(y.to(x.dtype), self.out_proj, self.out_bias)  # [T, hidden]
        y = self._torch_scan(xbc, dt, ssm_states, rb)  # [T, I]
        y = gated_group_rms_norm(y, z, self.norm, self.n_groups, self.eps)
        return linear(y.to(x.dtype), self.out_proj, self.out_bias)  # [T, hidden]
