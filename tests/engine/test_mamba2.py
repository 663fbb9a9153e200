"""Granite 4's Mamba-2 mixer (``structllm.model.mamba2``) against the token-by-token
recurrence and transformers 5.x (``segment_sum``, ``mamba2_chunk_scan``,
``GraniteMoeHybridMambaLayer``): whole sequences, chunked prefill across steps, decodes
and prefills of several slots in one step, fresh sequences in slots that held another's
state. Float32, within ~1e-5 relative."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from structllm.model.mamba2 import Mamba2, from_hf, hf_names, segment_sum, ssd
from structllm.model.recurrent import RecurrentBatch
from tests.support.recurrent import (
    STEP_LENGTHS,
    batch,
    carried_over,
    close,
    run_steps,
    seed_weights,
)

granite = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")

H, G, P, N = 4, 2, 8, 16  # two heads per group
CHUNK = 16
NUM_SLOTS = 5


def inputs(n: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Random ``x [n, H, P]``, ``dt [n, H]`` (> 0), ``A [H]`` (< 0), ``B, C [n, G, N]``,
    ``D [H]`` in the ranges the layer produces."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, P, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(n, H, generator=gen))
    a = -torch.empty(H).uniform_(0.5, 8, generator=gen)
    b = torch.randn(n, G, N, generator=gen)
    c = torch.randn(n, G, N, generator=gen)
    d = torch.randn(H, generator=gen)
    return x, dt, a, b, c, d


def recurrence(
    x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, s: Tensor
) -> tuple[Tensor, Tensor]:
    """The scan token by token, as written: -> ``(y [n, H, P], final state)``."""
    b = b.repeat_interleave(H // G, dim=1)
    c = c.repeat_interleave(H // G, dim=1)
    s = s.clone()
    out = []
    for t in range(x.shape[0]):
        s = (
            s * (dt[t] * a).exp()[:, None, None]
            + (dt[t][:, None] * x[t])[:, :, None] * b[t][:, None, :]
        )
        out.append(torch.einsum("hpn,hn->hp", s, c[t]) + d[:, None] * x[t])
    return torch.stack(out), s


def random_state(seed: int) -> Tensor:
    return torch.randn(H, P, N, generator=torch.Generator().manual_seed(seed))


def test_segment_sum_is_transformers() -> None:
    a = -torch.rand(3, 2, CHUNK)
    torch.testing.assert_close(segment_sum(a), granite.segment_sum(a), rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 2, 7, 15, 16, 17, 32, 50, 100])
@pytest.mark.parametrize("fresh", [True, False])
def test_scan_one_sequence(n: int, fresh: bool) -> None:
    """One prefill chunk (the chunked form) equals the recurrence and transformers'
    ``mamba2_chunk_scan``, from zero or from a slot's state; other slots stay."""
    x, dt, a, b, c, d = inputs(n, seed=n)
    s0 = torch.zeros(H, P, N) if fresh else random_state(1)
    states = torch.randn(NUM_SLOTS, H, P, N)
    before = states.clone()
    if not fresh:
        states[3] = s0
    y = ssd(x, dt, a, b, c, d, states, batch([(n, 3, fresh)], 0), CHUNK)
    want, s_end = recurrence(x, dt, a, b, c, d, s0)
    close(y, want)
    close(states[3], s_end)
    keep = [i for i in range(NUM_SLOTS) if i != 3]
    assert torch.equal(states[keep], before[keep])

    # transformers' chunk scan takes the time step before softplus: give it one whose
    # softplus is ours
    raw = torch.where(dt > 20, dt, dt.expm1().log())
    hf_y, hf_s = granite.mamba2_chunk_scan(
        x[None], raw[None], a, b[None], c[None], chunk_size=CHUNK, D=d,
        initial_states=s0[None], dt_softplus=True, return_final_states=True,
    )  # fmt: skip
    close(y, hf_y[0], rel=1e-4)
    close(states[3], hf_s[0], rel=1e-4)


def test_scan_mixed_step() -> None:
    """Three decodes (one fresh) and three prefill chunks (fresh, continuing) in one
    call, each slot its own, equal each sequence's recurrence; untouched slots stay."""
    plan = [(1, 4, False), (1, 0, False), (1, 2, True), (40, 1, False), (5, 3, True)]
    rows = sum(n for n, _, _ in plan)
    x, dt, a, b, c, d = inputs(rows, seed=7)
    states = torch.randn(NUM_SLOTS + 2, H, P, N)
    before = states.clone()
    y = ssd(x, dt, a, b, c, d, states, batch(plan, 3), CHUNK)
    i = 0
    for n, slot, fresh in plan:
        s0 = torch.zeros(H, P, N) if fresh else before[slot]
        sl = slice(i, i + n)
        want, s_end = recurrence(x[sl], dt[sl], a, b[sl], c[sl], d, s0)
        close(y[sl], want)
        close(states[slot], s_end)
        i += n
    assert torch.equal(states[NUM_SLOTS:], before[NUM_SLOTS:])


def test_scan_split_into_steps() -> None:
    """A sequence cut into chunks of 1, 3, 17, 64, 100 rows over calls (each 1 after
    the first as a decode) equals one pass."""
    cuts = [3, 1, 17, 64, 100, 1, 1]
    n = sum(cuts)
    x, dt, a, b, c, d = inputs(n, seed=3)
    want, s_end = recurrence(x, dt, a, b, c, d, torch.zeros(H, P, N))
    states = torch.randn(2, H, P, N)
    out, i = [], 0
    for k in cuts:
        rb = batch([(k, 1, i == 0)], 1 if k == 1 and i > 0 else 0)
        sl = slice(i, i + k)
        out.append(ssd(x[sl], dt[sl], a, b[sl], c[sl], d, states, rb, CHUNK))
        i += k
    close(torch.cat(out), want)
    close(states[1], s_end)


# ---------------------------------------------------------------------------------------
# The layer against transformers' GraniteMoeHybridMambaLayer

HIDDEN = 16  # mamba_expand 2: I = 32 = H * P


def hf_layer(seed: int = 0, proj_bias: bool = False) -> torch.nn.Module:
    cfg = granite.GraniteMoeHybridConfig(
        hidden_size=HIDDEN,
        mamba_n_heads=H,
        mamba_n_groups=G,
        mamba_d_state=N,
        mamba_d_head=P,
        mamba_expand=2,
        mamba_d_conv=4,
        mamba_chunk_size=CHUNK,
        mamba_conv_bias=True,
        mamba_proj_bias=proj_bias,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        layer_types=["mamba"],
    )
    layer = seed_weights(granite.GraniteMoeHybridMambaLayer(cfg, 0), seed, (0.5, 8))
    layer.cfg = cfg
    return layer


def ours_from(hf: torch.nn.Module) -> Mamba2:
    return carried_over(Mamba2.from_config(hf.cfg), hf, from_hf)  # type: ignore[return-value]


def empty_states(layer: Mamba2, slots: int) -> tuple[Tensor, Tensor]:
    """Garbage in every slot (a fresh sequence must not read it)."""
    conv, ssm = layer.state_shapes()
    return torch.randn(slots, *conv), torch.randn(slots, *ssm)


def test_names_and_shapes() -> None:
    hf = hf_layer()
    assert hf_names("model.layers.0.mamba.")["conv1d"] == "model.layers.0.mamba.conv1d.weight"
    ours = ours_from(hf)
    conv_dim = H * P + 2 * G * N
    assert ours.conv1d.shape == (conv_dim, 4)
    assert ours.state_shapes() == ((conv_dim, 3), (H, P, N))
    assert set(Mamba2.PACKED) <= {n for n, _ in ours.named_parameters()}


@pytest.mark.parametrize("proj_bias", [False, True])
@torch.no_grad()
def test_layer_whole_sequence(proj_bias: bool) -> None:
    hf = hf_layer(proj_bias=proj_bias)
    ours = ours_from(hf)
    x = torch.randn(1, 150, HIDDEN, generator=torch.Generator().manual_seed(5))
    want = hf(x)[0]
    conv, ssm = empty_states(ours, 3)
    got = ours(x[0], (conv, ssm), batch([(150, 2, True)], 0))
    close(got, want)


@torch.no_grad()
def test_layer_steps_mixed() -> None:
    """Three sequences scheduled over steps in chunks of 1, 3, 17, 64, 100 rows, decodes
    and prefills of different slots in the same step, each starting fresh in a slot that
    held other states: each sequence's rows equal transformers' whole pass."""
    hf = hf_layer(seed=1)
    ours = ours_from(hf)
    gen = torch.Generator().manual_seed(9)
    xs = [torch.randn(n, HIDDEN, generator=gen) for n in STEP_LENGTHS]
    got = run_steps(ours, xs, empty_states(ours, 6), [4, 0, 2])
    for x, rows in zip(xs, got, strict=True):
        close(rows, hf(x[None])[0])


@pytest.mark.parametrize("proj_bias", [False, True])
@torch.no_grad()
def test_native_decode_rows_match_transformers(proj_bias: bool) -> None:
    """The decode rows through ``cpu_recurrent.cpp`` (``ssm_decode``, ``group_norm``:
    the functions the native decode loop runs), decodes beside prefills of other slots
    (``Mamba2._native_scan``'s split), each sequence fresh in a slot that held other
    states: each sequence's rows equal transformers' whole pass. Run under
    ``STRUCTLLM_CPU_ISA=avx2`` too for the AVX2 build."""
    from structllm.kernels import cpu_ext

    native = cpu_ext.load_recurrent()
    if native is None:
        pytest.skip("the recurrent kernels do not build here")
    hf = hf_layer(seed=5, proj_bias=proj_bias)
    ours = ours_from(hf)
    calls: list[int] = []

    def mixer(x: Tensor, states: tuple[Tensor, ...], rb: RecurrentBatch) -> Tensor:
        calls.append(rb.num_decodes)
        return ours(x, states, dataclasses.replace(rb, native=native))

    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(n, HIDDEN, generator=gen) for n in STEP_LENGTHS]
    got = run_steps(mixer, xs, empty_states(ours, 6), [4, 0, 2])
    assert any(calls) and not all(calls)  # decode rows, alone and beside prefills
    for x, rows in zip(xs, got, strict=True):
        close(rows, hf(x[None])[0])


@torch.no_grad()
def test_fresh_slot_ignores_old_state() -> None:
    """A sequence started in a slot another sequence used gives the same rows as in a
    clean slot, by prefill and by a one-row first step taken as a decode."""
    hf = hf_layer(seed=2)
    ours = ours_from(hf)
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(4))
    conv, ssm = empty_states(ours, 2)
    ours(torch.randn(30, HIDDEN), (conv, ssm), batch([(30, 1, True)], 0))  # slot 1 used
    clean = ours(x, (torch.zeros_like(conv), torch.zeros_like(ssm)), batch([(20, 0, True)], 0))
    close(ours(x, (conv, ssm), batch([(20, 1, True)], 0)), clean)
    ours(torch.randn(30, HIDDEN), (conv, ssm), batch([(30, 1, True)], 0))
    first = ours(x[:1], (conv, ssm), batch([(1, 1, True)], 1))
    rest = ours(x[1:], (conv, ssm), batch([(19, 1, False)], 0))
    close(torch.cat([first, rest]), clean)


@torch.no_grad()
def test_layer_in_bfloat16() -> None:
    """bfloat16 weights and activations beside the runner's float32 states (the
    convolution's window in the activations' dtype), a prefill then decodes: off the
    float32 layer by no more than transformers' own layer in bfloat16 is (the gated
    group norm magnifies rounding in a small group: ~1 on some rows for both)."""
    hf = hf_layer(seed=3)
    ours = ours_from(hf)
    half = ours_from(hf).to(torch.bfloat16)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(6))
    got, want = [], []
    for layer, out, dtype in ((ours, want, torch.float32), (half, got, torch.bfloat16)):
        conv, ssm = empty_states(ours, 2)
        out.append(layer(x[:37].to(dtype), (conv, ssm), batch([(37, 1, True)], 0)))
        for i in range(37, 40):
            out.append(layer(x[i : i + 1].to(dtype), (conv, ssm), batch([(1, 1, False)], 1)))
    assert got[0].dtype == torch.bfloat16
    exact = torch.cat(want)
    theirs = hf.to(torch.bfloat16)(x[None].bfloat16())[0].float()
    err = (torch.cat(got).float() - exact).abs().max(-1).values  # [40]
    their_err = (theirs - exact).abs().max(-1).values
    assert (err <= 1.5 * their_err + 0.02).all(), (err, their_err)
