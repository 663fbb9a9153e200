"""Qwen3.5's recurrent layer, the Gated DeltaNet mixer (transformers'
``Qwen3_5GatedDeltaNet``), over the per-slot states of ``recurrent``.

Per value head, the layer keeps a matrix state ``S [Dk, Dv]`` (a fast-weight memory from
keys to values). With ``q, k`` l2-normalised and ``a_t = exp(g_t)`` the decay (``g <= 0``),
``beta_t`` in (0, 1) the write strength, token ``t`` does

    S   <- a_t S                              (decay)
    u_t  = beta_t (v_t - S^T k_t)             (the delta: what S mispredicts for k_t)
    S   <- S + k_t u_t^T                      (write the correction)
    o_t  = S^T q_t / sqrt(Dk)

(``S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``). Key heads are shared
by ``Hv / Hk`` consecutive value heads (value head ``h`` reads key head ``h // (Hv/Hk)``,
transformers' ``repeat_interleave``).

Prefill chunks run the chunked (WY / UT-transform) form that transformers'
``torch_chunk_gated_delta_rule`` and FLA use; see ``_chunked``. Decode rows run the
recurrence above as one batched update over all decoding slots. Where the recurrent
kernels are in use (``RecurrentBatch.native``), both run in ``cpu_recurrent.cpp``
(``delta_decode``, ``delta_prefill``: the same chunked form, all sequences in one call),
as do the layer's inputs and gated norm (``GatedDeltaNet._native_rule``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.packed import Weight, linear
from structllm.model.recurrent import RecurrentBatch, causal_conv1d, take_layer

CHUNK = 64  # rows per chunk of the chunked form (transformers' and FLA's)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension, as transformers' (and FLA's)
    ``l2norm`` (in float32)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _expand_heads(x: Tensor, hv: int) -> Tensor:
    """``[..., Hk, D]`` -> ``[..., Hv, D]``: each key head repeated for its value heads."""
    hk = x.shape[-2]
    return x if hk == hv else x.repeat_interleave(hv // hk, dim=-2)


def _chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s0: Tensor, chunk: int = CHUNK
) -> tuple[Tensor, Tensor]:
    """One sequence's rows by the chunked form. ``q, k: [H, L, Dk]`` (q already scaled),
    ``v: [H, L, Dv]``, ``g, beta: [H, L]``, ``s0: [H, Dk, Dv]`` the state before row 0
    -> ``(o [H, L, Dv], final state [H, Dk, Dv])``, all float32.

    The chunk trick. Within a chunk of ``C`` rows starting from state ``S0``, with
    ``c_t = g_1 + ... + g_t`` (the log decay from the chunk's start to row ``t``), the
    state just before row ``t``'s write is ``e^{c_t} S0 + sum_{j<t} e^{c_t - c_j} k_j u_j^T``,
    so the deltas satisfy a unit lower-triangular system

        u_t + sum_{j<t} beta_t e^{c_t - c_j} (k_t . k_j) u_j = beta_t v_t - beta_t e^{c_t} S0^T k_t

    i.e. ``(I + A) U = V_beta - W S0`` with ``A`` strictly lower ``[C, C]`` and
    ``W = K_beta e^{c}``. Solving it once per chunk for ``V_beta`` and for ``W`` (both
    independent of ``S0``, so every chunk is solved at once, in parallel) leaves only
    two ``[C, Dk] @ [Dk, Dv]`` matmuls per chunk in the sequential scan:
    ``U = U0 - W' S0``; the outputs are ``o_t = e^{c_t} S0^T q_t + sum_{j<=t}
    e^{c_t - c_j} (q_t . k_j) u_j`` (a causal "attention" inside the chunk plus a read
    of ``S0``), and the next chunk starts from ``e^{c_C} S0 + sum_j e^{c_C - c_j} k_j u_j^T``.
    Padding rows (``k = v = beta = g = 0``) leave the state as it is.
    """
    h, n, dk = k.shape
    dv = v.shape[-1]
    c = min(chunk, n)  # a short chunk is one chunk of its own length, unpadded
    pad = -n % c
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    m = (n + pad) // c  # chunks
    q, k, v = (x.reshape(h, m, c, x.shape[-1]) for x in (q, k, v))  # [H, M, C, D]
    g, beta = g.reshape(h, m, c), beta.reshape(h, m, c)  # [H, M, C]

    cum = g.cumsum(-1)  # [H, M, C]: c_t
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    # [H, M, C, C]: e^{c_i - c_j} for j <= i, 0 above the diagonal
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]  # [H, M, C, Dk]
    v_beta = v * beta[..., None]  # [H, M, C, Dv]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [H, M, C, C]; its diagonal is unused
    rhs = torch.cat([v_beta, k_beta * cum.exp()[..., None]], dim=-1)  # [H, M, C, Dv + Dk]
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u0, w = sol.split([dv, dk], dim=-1)  # [H, M, C, Dv], [H, M, C, Dk]
    attn = (q @ k.transpose(-1, -2)) * decay  # [H, M, C, C]: causal, diagonal included
    q_read = q * cum.exp()[..., None]  # [H, M, C, Dk]: reads S0 decayed to row t
    last = cum[..., -1:]  # [H, M, 1]
    k_write = k * (last - cum).exp()[..., None]  # [H, M, C, Dk]: writes decayed to the end
    chunk_decay = last.exp()[..., None]  # [H, M, 1, 1]

    o = torch.empty(h, m, c, dv, dtype=torch.float32, device=q.device)
    s = s0  # [H, Dk, Dv]
    for i in range(m):
        u = u0[:, i] - w[:, i] @ s  # [H, C, Dv]
        o[:, i] = q_read[:, i] @ s + attn[:, i] @ u
        s = s * chunk_decay[:, i] + k_write[:, i].transpose(-1, -2) @ u
    return o.reshape(h, m * c, dv)[:, :n], s


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    rb: RecurrentBatch,
    scale: float | None = None,
) -> Tensor:
    """The gated delta rule over a step's rows (see the module's docstring).

    ``q, k: [T, Hk, Dk]``, **already l2-normalised** by the caller (``l2norm``; the
    rule does not normalise them); ``q`` is multiplied here by ``scale`` (default
    ``Dk ** -0.5``, as transformers does). ``v: [T, Hv, Dv]``; ``g: [T, Hv]`` the log
    decay (``<= 0``); ``beta: [T, Hv]``; ``Hv`` a multiple of ``Hk``. ``states:
    [S, Hv, Dk, Dv]`` float32, one per slot, finite: the rows of ``rb``'s slots are read
    (taken as zero where ``fresh``) and replaced by their sequences' states after this
    step's rows. Returns ``o: [T, Hv, Dv]`` float32. Math in float32 whatever the inputs' dtype.
    """
    t, hv, dv = v.shape
    dk = k.shape[-1]
    if hv % k.shape[1]:
        raise ValueError(f"{hv} value heads are not a multiple of {k.shape[1]} key heads")
    scale = dk**-0.5 if scale is None else scale
    q = _expand_heads(q.float() * scale, hv)  # [T, Hv, Dk]
    k = _expand_heads(k.float(), hv)  # [T, Hv, Dk]
    v, g, beta = v.float(), g.float(), beta.float()
    o = torch.empty(t, hv, dv, dtype=torch.float32, device=v.device)

    nd = rb.num_decodes
    if nd and rb.native is not None:  # two passes over each state (cpu_recurrent.cpp)
        o[:nd] = rb.native.delta_decode(
            q[:nd].contiguous(),
            k[:nd].contiguous(),
            v[:nd].contiguous(),
            g[:nd].contiguous(),
            beta[:nd].contiguous(),
            states,
            rb.slots[:nd],
            rb.fresh_mask[:nd],
        )
    elif nd:
        # The decodes' recurrence in one batched update. With S the slot's state and
        # a = e^g: S^T k and S^T q read the old state in one matmul, then
        # u = beta (v - a S^T k), S' = a S + k u^T, o = S'^T q = a S^T q + (q . k) u.
        # A fresh sequence's S is zero: a is zeroed for it (the slot's old values, finite,
        # are gathered but multiplied away; cheaper than ``rb.decode_states``' extra pass
        # over the states).
        s = states[rb.slots[:nd]]  # [nd, Hv, Dk, Dv] (a copy)
        a = g[:nd].exp() * (~rb.fresh_mask[:nd])[:, None]  # [nd, Hv]
        qk = torch.stack([q[:nd], k[:nd]], dim=2)  # [nd, Hv, 2, Dk]
        read = (qk @ s) * a[..., None, None]  # [nd, Hv, 2, Dv]: a S^T q, a S^T k
        u = beta[:nd, :, None] * (v[:nd] - read[:, :, 1])  # [nd, Hv, Dv]
        dot = (q[:nd] * k[:nd]).sum(-1, keepdim=True)  # [nd, Hv, 1]
        o[:nd] = read[:, :, 0] + dot * u
        s.mul_(a[..., None, None])
        s.view(-1, dk, dv).baddbmm_(k[:nd].reshape(-1, dk, 1), u.reshape(-1, 1, dv))
        states[rb.slots[:nd]] = s

    # every prefill row in one call (cpu_recurrent.cpp; its vectors: 16-float multiples)
    if rb.num_seqs > nd and rb.native is not None and dk % 16 == 0 and dv % 16 == 0:
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        rb.native.delta_prefill(q, k, v, g, beta, states, rb.segments(), o)
        return o
    for first, end, slot, fresh in rb.prefills(states):
        s0 = states.new_zeros(states.shape[1:]) if fresh else states[slot]  # [Hv, Dk, Dv]
        # heads first: [H, L, D] and [H, L]
        qs, ks, vs, gs, bs = (x[first:end].transpose(0, 1) for x in (q, k, v, g, beta))
        out, s_end = _chunked(qs, ks, vs, gs, bs, s0)
        o[first:end] = out.transpose(0, 1)
        states[slot] = s_end
    return o


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' ``Qwen3_5RMSNormGated``: ``rms_norm(x) * weight * silu(z)`` over the
    last dimension (the plain weight, not ``1 + w``), in float32."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * x * F.silu(z.float())


# our parameter -> its tensor in a Hugging Face layer, under ``model.layers.{i}.linear_attn.``
HF_NAMES: dict[str, str] = {
    "in_proj_qkv": "in_proj_qkv.weight",
    "in_proj_z": "in_proj_z.weight",
    "in_proj_b": "in_proj_b.weight",
    "in_proj_a": "in_proj_a.weight",
    "conv1d": "conv1d.weight",
    "dt_bias": "dt_bias",
    "A_log": "A_log",
    "norm": "norm.weight",
    "out_proj": "out_proj.weight",
}


def hf_names(prefix: str = "") -> dict[str, str]:
    """Our names -> the Hugging Face names, each after ``prefix`` (for example
    ``"model.layers.3.linear_attn."``)."""
    return {ours: prefix + theirs for ours, theirs in HF_NAMES.items()}


def from_hf(state: dict[str, Tensor], hf_prefix: str, prefix: str = "") -> dict[str, Tensor]:
    """Take (pop) one layer's ``linear_attn.*`` tensors from a Hugging Face ``state``
    (their names after ``hf_prefix``, e.g. ``"model.layers.3.linear_attn."``) -> ours
    after ``prefix`` (e.g. ``"layers.3.mixer."``), the convolution's as ``[C, K]``."""
    return take_layer(state, HF_NAMES, hf_prefix, prefix)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer (transformers' ``Qwen3_5GatedDeltaNet``).

    Parameters (our names; ``Kd = Hk * Dk``, ``Vd = Hv * Dv``, ``C = 2 Kd + Vd``):
    ``in_proj_qkv [C, hidden]`` (rows q, k, v), ``in_proj_z [Vd, hidden]`` (the output
    gate), ``in_proj_b [Hv, hidden]`` (beta, before its sigmoid), ``in_proj_a [Hv,
    hidden]`` (the decay's time step), ``conv1d [C, K]`` (no bias), ``dt_bias [Hv]``,
    ``A_log [Hv]``, ``norm [Dv]`` (the gated RMSNorm's plain weight), ``out_proj [hidden,
    Vd]``. The matmul weights (``LINEARS``) may be any ``packed.Weight``.

    States per slot (``state_shapes``): the convolution's ``[C, K - 1]`` in the
    activations' dtype (float32 on the CPU path) and the delta rule's ``[Hv, Dk, Dv]``
    in float32.
    """

    LINEARS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    PACKED = LINEARS  # (LlamaModel.pack_weights packs the modules with PACKED)

    def __init__(
        self,
        hidden_size: int,
        linear_num_key_heads: int,
        linear_num_value_heads: int,
        linear_key_head_dim: int,
        linear_value_head_dim: int,
        linear_conv_kernel_dim: int,
        rms_norm_eps: float,
        dtype: torch.dtype = torch.float32,
        tiled_values: bool = False,
    ) -> None:
        super().__init__()
        # the value heads' order: grouped by key head (Hugging Face's: value head h reads
        # key head h // (Hv / Hk)) or tiled (llama.cpp's converter reorders them so: h % Hk)
        self.tiled_values = tiled_values
        if linear_num_value_heads % linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        self.num_k_heads, self.num_v_heads = linear_num_key_heads, linear_num_value_heads
        self.head_k_dim, self.head_v_dim = linear_key_head_dim, linear_value_head_dim
        self.key_dim = linear_num_key_heads * linear_key_head_dim
        self.value_dim = linear_num_value_heads * linear_value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = linear_conv_kernel_dim
        self.eps = rms_norm_eps

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        h, hv = hidden_size, linear_num_value_heads
        self.in_proj_qkv: Weight = p(self.conv_dim, h)
        self.in_proj_z: Weight = p(self.value_dim, h)
        self.in_proj_b: Weight = p(hv, h)
        self.in_proj_a: Weight = p(hv, h)
        self.conv1d = p(self.conv_dim, linear_conv_kernel_dim)
        self.dt_bias = p(hv)
        self.A_log = p(hv)
        self.norm = p(linear_value_head_dim)
        self.out_proj: Weight = p(h, self.value_dim)

    @classmethod
    def from_config(cls, cfg: Any, dtype: torch.dtype = torch.float32) -> GatedDeltaNet:
        """From anything with the constructor's names as attributes (transformers'
        ``Qwen3_5TextConfig``, for one)."""
        return cls(
            cfg.hidden_size,
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim,
            cfg.rms_norm_eps,
            dtype,
        )

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """This layer's ``shapes_of`` (``hybrid.Mixer``'s)."""
        return (self.conv_dim, self.kernel - 1), (
            self.num_v_heads,
            self.head_k_dim,
            self.head_v_dim,
        )

    @staticmethod
    def shapes_of(cfg: Any) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One slot's state shapes, ``((C, K - 1), (Hv, Dk, Dv))``: the convolution's
        (``C = 2 Hk Dk + Hv Dv``) and the delta rule's, for ``cfg`` with the
        constructor's names as attributes (transformers' ``Qwen3_5TextConfig``)."""
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return (2 * hk * dk + hv * dv, cfg.linear_conv_kernel_dim - 1), (hv, dk, dv)

    def _native_rule(
        self, qkv: Tensor, b: Tensor, a: Tensor, states: Tensor, rb: RecurrentBatch
    ) -> Tensor:
        """The delta rule from the convolution's output ``qkv [T, C]`` through
        ``cpu_recurrent.cpp`` alone: its inputs in one pass (``delta_inputs``: what
        ``forward`` computes in torch's ops), the decode rows, then every prefill row
        -> ``o [T, Hv, Dv]`` float32."""
        nat, nd, dk = rb.native, rb.num_decodes, self.head_k_dim
        q, k, v, g, beta = nat.delta_inputs(
            qkv,
            b.float().contiguous(),
            a.float().contiguous(),
            self.A_log.float().contiguous(),
            self.dt_bias.float().contiguous(),
            self.num_k_heads,
            dk,
            self.head_v_dim,
            self.tiled_values,
            dk**-0.5,
        )
        o = torch.empty_like(v)
        if nd:
            o[:nd] = nat.delta_decode(
                q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], states, rb.slots[:nd], rb.fresh_mask[:nd]
            )
        if rb.num_seqs > nd:
            nat.delta_prefill(q, k, v, g, beta, states, rb.segments(), o)
        return o

    def forward(self, x: Tensor, states: tuple[Tensor, ...], rb: RecurrentBatch) -> Tensor:
        """``x: [T, hidden]`` (the step's rows as ``rb`` lays them out), ``states``: the
        convolution's ``[S, C, K - 1]`` and the rule's ``[S, Hv, Dk, Dv]`` float32 (both
        updated in place for ``rb``'s slots) -> ``[T, hidden]``."""
        conv_states, rec_states = states
        t = x.shape[0]
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        qkv = linear(x, self.in_proj_qkv)  # [T, C]
        z = linear(x, self.in_proj_z)  # [T, Vd]
        b = linear(x, self.in_proj_b)  # [T, Hv]
        a = linear(x, self.in_proj_a)  # [T, Hv]
        qkv = causal_conv1d(qkv, self.conv1d, None, conv_states, rb, silu=True)  # [T, C]
        if rb.native is not None and dk % 16 == 0 and dv % 16 == 0 and qkv.dtype == torch.float32:
            o = self._native_rule(qkv, b, a, rec_states, rb)  # [T, Hv, Dv]
            y = rb.native.gated_norm(o, z.float().contiguous(), self.norm.float(), self.eps)
            return linear(y.to(x.dtype), self.out_proj)  # [T, hidden]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(t, hk, dk))  # [T, Hk, Dk]
        k = l2norm(k.reshape(t, hk, dk))  # [T, Hk, Dk]
        if self.tiled_values and hv != hk:  # [T, Hv, Dk]: K0 .. K(Hk-1), K0 .. again
            q, k = q.repeat(1, hv // hk, 1), k.repeat(1, hv // hk, 1)
        beta = b.float().sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [T, Hv]
        o = gated_delta_rule(q, k, v.reshape(t, hv, dv), g, beta, rec_states, rb)  # [T, Hv, Dv]
        o = gated_rms_norm(o, z.reshape(t, hv, dv), self.norm, self.eps)  # [T, Hv, Dv]
        return linear(o.reshape(t, self.value_dim).to(x.dtype), self.out_proj)  # [T, hidden]
