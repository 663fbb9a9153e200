"""Qwen3.5's Gated DeltaNet (``structllm.model.deltanet``) against the token-by-token
recurrence and transformers 5.x (``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``, ``Qwen3_5GatedDeltaNet``): whole sequences,
chunked prefill across steps, decodes and prefills of several slots in one step, fresh
sequences in slots that held another's state. Float32, within ~1e-5 relative."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from structllm.model.deltanet import (
    GatedDeltaNet,
    from_hf,
    gated_delta_rule,
    hf_names,
    l2norm,
)
from tests.support.recurrent import (
    STEP_LENGTHS,
    batch,
    carried_over,
    close,
    run_steps,
    seed_weights,
)

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

HK, HV, DK, DV = 2, 4, 16, 8  # GQA: Hv = 2 Hk
NUM_SLOTS = 5


def inputs(n: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Random ``q, k`` (l2-normalised) ``[n, Hk, Dk]``, ``v [n, Hv, Dv]``, ``g, beta [n,
    Hv]`` in the ranges the layer produces."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, HK, DK, generator=gen))
    k = l2norm(torch.randn(n, HK, DK, generator=gen))
    v = torch.randn(n, HV, DV, generator=gen)
    g = -torch.rand(n, HV, generator=gen).exp() * torch.nn.functional.softplus(
        torch.randn(n, HV, generator=gen)
    )
    beta = torch.rand(n, HV, generator=gen)
    return q, k, v, g, beta


def recurrence(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor
) -> tuple[Tensor, Tensor]:
    """The rule token by token, as written: -> ``(o [n, Hv, Dv], final state)``."""
    r = HV // HK
    q = q.repeat_interleave(r, dim=1) * DK**-0.5
    k = k.repeat_interleave(r, dim=1)
    s = s.clone()
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], s))
        s = s + k[t][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(out), s


def random_state(seed: int) -> Tensor:
    return torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 2, 7, 63, 64, 65, 128, 130, 200])
@pytest.mark.parametrize("fresh", [True, False])
def test_rule_one_sequence(n: int, fresh: bool) -> None:
    """One prefill chunk (the chunked form) equals the recurrence and transformers' two
    functions, from zero or from a slot's state; the other slots stay as they were."""
    q, k, v, g, beta = inputs(n, seed=n)
    s0 = torch.zeros(HV, DK, DV) if fresh else random_state(1)
    states = torch.randn(NUM_SLOTS, HV, DK, DV)
    before = states.clone()
    states[3] = s0 if not fresh else states[3]
    o = gated_delta_rule(q, k, v, g, beta, states, batch([(n, 3, fresh)], 0))
    want, s_end = recurrence(q, k, v, g, beta, s0)
    close(o, want)
    close(states[3], s_end)
    keep = [i for i in range(NUM_SLOTS) if i != 3]
    assert torch.equal(states[keep], before[keep])

    args = [x[None] for x in (q, k, v)]
    for fn in (qwen3_5.torch_chunk_gated_delta_rule, qwen3_5.torch_recurrent_gated_delta_rule):
        hf_o, hf_s = fn(
            *args,
            g=g[None],
            beta=beta[None],
            initial_state=s0[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
        )
        close(o, hf_o[0])
        close(states[3], hf_s[0])


def test_rule_l2norm_matches_transformers_in_kernel() -> None:
    """Our ``l2norm`` before the rule is transformers' ``use_qk_l2norm_in_kernel``."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 40, HK, DK, generator=gen)
    _, _, v, g, beta = inputs(40, seed=1)
    states = torch.zeros(1, HV, DK, DV)
    o = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta, states, batch([(40, 0, True)], 0))
    hf_o, hf_s = qwen3_5.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    close(o, hf_o[0])
    close(states[0], hf_s[0])


def test_rule_mixed_step() -> None:
    """Three decodes (one fresh) and three prefill chunks (fresh, continuing) in one call,
    each slot its own, equal each sequence's recurrence; untouched slots stay."""
    plan = [(1, 4, False), (1, 0, False), (1, 2, True), (70, 1, False), (5, 3, True)]
    nd = 3
    rows = sum(n for n, _, _ in plan)
    q, k, v, g, beta = inputs(rows, seed=7)
    states = torch.randn(NUM_SLOTS + 2, HV, DK, DV)
    before = states.clone()
    o = gated_delta_rule(q, k, v, g, beta, states, batch(plan, nd))
    a = 0
    for n, slot, fresh in plan:
        s0 = torch.zeros(HV, DK, DV) if fresh else before[slot]
        want, s_end = recurrence(q[a : a + n], k[a : a + n], v[a : a + n], g[a : a + n],
                                 beta[a : a + n], s0)  # fmt: skip
        close(o[a : a + n], want)
        close(states[slot], s_end)
        a += n
    assert torch.equal(states[NUM_SLOTS:], before[NUM_SLOTS:])


def test_rule_split_into_steps() -> None:
    """A sequence cut into chunks of 1, 3, 17, 64, 100 rows over five calls (the 1 as a
    decode after the first) equals one pass."""
    cuts = [3, 1, 17, 64, 100, 1, 1]
    n = sum(cuts)
    q, k, v, g, beta = inputs(n, seed=3)
    want, s_end = recurrence(q, k, v, g, beta, torch.zeros(HV, DK, DV))
    states = torch.randn(2, HV, DK, DV)
    out, a = [], 0
    for c in cuts:
        rb = batch([(c, 1, a == 0)], 1 if c == 1 and a > 0 else 0)
        sl = slice(a, a + c)
        out.append(gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], states, rb))
        a += c
    close(torch.cat(out), want)
    close(states[1], s_end)


# ---------------------------------------------------------------------------------------
# The layer against transformers' Qwen3_5GatedDeltaNet

HIDDEN = 32


def hf_layer(seed: int = 0) -> torch.nn.Module:
    cfg = qwen3_5.Qwen3_5TextConfig(
        hidden_size=HIDDEN,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    layer = seed_weights(qwen3_5.Qwen3_5GatedDeltaNet(cfg, 0), seed, (0.01, 4))
    layer.cfg = cfg
    return layer


def ours_from(hf: torch.nn.Module) -> GatedDeltaNet:
    return carried_over(GatedDeltaNet.from_config(hf.cfg), hf, from_hf)  # type: ignore[return-value]


def empty_states(cfg: object, slots: int) -> tuple[Tensor, Tensor]:
    """Garbage in every slot (a fresh sequence must not read it)."""
    conv, rec = GatedDeltaNet.shapes_of(cfg)
    return torch.randn(slots, *conv), torch.randn(slots, *rec)


def test_names_and_shapes() -> None:
    hf = hf_layer()
    names = hf_names("model.layers.0.linear_attn.")
    assert names["conv1d"] == "model.layers.0.linear_attn.conv1d.weight"
    ours = ours_from(hf)
    assert ours.conv1d.shape == (ours.conv_dim, 4)
    assert GatedDeltaNet.shapes_of(hf.cfg) == ((2 * HK * DK + HV * DV, 3), (HV, DK, DV))
    assert set(GatedDeltaNet.LINEARS) <= {n for n, _ in ours.named_parameters()}


@torch.no_grad()
def test_layer_whole_sequence() -> None:
    hf = hf_layer()
    ours = ours_from(hf)
    x = torch.randn(1, 150, HIDDEN, generator=torch.Generator().manual_seed(5))
    want = hf(x)[0]
    conv, rec = empty_states(hf.cfg, 3)
    got = ours(x[0], (conv, rec), batch([(150, 2, True)], 0))
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
    got = run_steps(ours, xs, empty_states(hf.cfg, 6), [4, 0, 2])
    for x, rows in zip(xs, got, strict=True):
        close(rows, hf(x[None])[0])


@torch.no_grad()
def test_fresh_slot_ignores_old_state() -> None:
    """A sequence started in a slot another sequence used gives the same rows as in a
    clean slot, by prefill and by a one-row first step taken as a decode."""
    hf = hf_layer(seed=2)
    ours = ours_from(hf)
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(4))
    conv, rec = empty_states(hf.cfg, 2)
    ours(torch.randn(30, HIDDEN), (conv, rec), batch([(30, 1, True)], 0))  # slot 1 used
    clean = ours(x, (torch.zeros_like(conv), torch.zeros_like(rec)), batch([(20, 0, True)], 0))
    close(ours(x, (conv, rec), batch([(20, 1, True)], 0)), clean)
    ours(torch.randn(30, HIDDEN), (conv, rec), batch([(30, 1, True)], 0))
    first = ours(x[:1], (conv, rec), batch([(1, 1, True)], 1))
    rest = ours(x[1:], (conv, rec), batch([(19, 1, False)], 0))
    close(torch.cat([first, rest]), clean)
