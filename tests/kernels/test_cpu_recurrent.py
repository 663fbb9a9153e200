"""The recurrent layers' native decode steps (``cpu_recurrent.cpp``) against the torch
path they replace (``recurrent.causal_conv1d``, ``deltanet.gated_delta_rule``), on both
ISA builds: the same outputs and the same states left in every slot, fresh sequences
(whose slots hold another sequence's values) included, other slots untouched."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from structllm.kernels import cpu_ext
from structllm.kernels.attention import AttentionMetadata
from structllm.model.deltanet import GatedDeltaNet, gated_delta_rule, l2norm
from structllm.model.recurrent import RecurrentBatch, causal_conv1d

pytestmark = pytest.mark.skipif(cpu_ext.best_isa() is None, reason="no AVX2 on this CPU")
ISAS = [i for i in cpu_ext.ISAS if cpu_ext.best_isa() in (i, "avx512")]

SLOTS = [4, 0, 2, 5]  # four decode rows; slot 1 and 3 belong to nobody in this step
FRESH = [False, True, False, True]


def decode_batch(native: object) -> RecurrentBatch:
    """Four one-token sequences: two continuing (positions 7 and 3), two fresh."""
    lens = [8, 1, 4, 1]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(4, dtype=torch.long),
        block_tables=torch.zeros(4, 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.arange(5, dtype=torch.int32),
        seq_lens_list=lens,
        query_start_list=list(range(5)),
        num_decodes=4,
        max_seq_len=8,
    )
    rb = RecurrentBatch.from_meta(meta, SLOTS, native)
    assert rb.fresh == FRESH
    return rb


def module(isa: str) -> object:
    native = cpu_ext.load_recurrent(isa)
    if native is None:
        pytest.skip(f"the {isa} recurrent kernels do not build here")
    return native


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bias", [False, True])
def test_conv_decode_equals_the_torch_path(isa: str, bias: bool) -> None:
    native = module(isa)
    g = torch.Generator().manual_seed(0)
    c, k = 96, 4
    x = torch.randn(4, c, generator=g)
    w = torch.randn(c, k, generator=g)
    b = torch.randn(c, generator=g) if bias else None
    states = torch.randn(6, c, k - 1, generator=g)
    ours, ref = states.clone(), states.clone()
    got = causal_conv1d(x, w, b, ours, decode_batch(native), silu=True)
    want = causal_conv1d(x, w, b, ref, decode_batch(None), silu=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)  # the windows, shifted exactly
    assert torch.equal(ours[[1, 3]], states[[1, 3]])


@pytest.mark.parametrize("isa", ISAS)
def test_delta_decode_equals_the_torch_path(isa: str) -> None:
    native = module(isa)
    g = torch.Generator().manual_seed(1)
    hk, hv, dk, dv = 2, 4, 32, 48
    q = l2norm(torch.randn(4, hk, dk, generator=g))
    k = l2norm(torch.randn(4, hk, dk, generator=g))
    v = torch.randn(4, hv, dv, generator=g)
    decay = -torch.rand(4, hv, generator=g)
    beta = torch.rand(4, hv, generator=g)
    states = torch.randn(6, hv, dk, dv, generator=g)
    ours, ref = states.clone(), states.clone()
    got = gated_delta_rule(q, k, v, decay, beta, ours, decode_batch(native))
    want = gated_delta_rule(q, k, v, decay, beta, ref, decode_batch(None))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours[[1, 3]], states[[1, 3]])


@pytest.mark.parametrize("isa", ISAS)
def test_a_slot_out_of_range_is_refused(isa: str) -> None:
    native = module(isa)
    x, w, states = torch.zeros(1, 8), torch.zeros(8, 3), torch.zeros(2, 8, 2)
    with pytest.raises(RuntimeError, match="state slot out of range"):
        native.conv_decode(  # type: ignore[attr-defined]
            x, w, None, states, torch.tensor([2]), torch.tensor([False]), False
        )


# Prefill: a step of two decodes then four prefill chunks of other lengths, fresh and
# continuing, one over several chunks of 64 and one shorter than the convolution's window,
# the 150-row one saving its state 70 rows in (to saved row 7).
# (rows, slot, fresh)
MIXED = [(1, 4, False), (1, 0, True), (150, 2, True), (5, 5, False), (2, 1, False), (64, 3, False)]
SAVE = (2, 70, 7)  # (sequence, rows into its chunk, saved row)


def mixed_batch(native: object) -> RecurrentBatch:
    starts = [0]
    for n, _, _ in MIXED:
        starts.append(starts[-1] + n)
    slots, fresh = [s for _, s, _ in MIXED], [f for _, _, f in MIXED]
    return RecurrentBatch(
        starts,
        slots,
        torch.tensor(slots),
        fresh,
        torch.tensor(fresh),
        2,
        native,
        (SAVE,),
    )


ROWS = sum(n for n, _, _ in MIXED)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bias", [False, True])
def test_conv_prefill_equals_the_torch_path(isa: str, bias: bool) -> None:
    native = module(isa)
    g = torch.Generator().manual_seed(2)
    c, k = 80, 4
    x = torch.randn(ROWS, c, generator=g)
    w = torch.randn(c, k, generator=g)
    b = torch.randn(c, generator=g) if bias else None
    states = torch.randn(9, c, k - 1, generator=g)
    ours, ref = states.clone(), states.clone()
    got = causal_conv1d(x, w, b, ours, mixed_batch(native), silu=True)
    want = causal_conv1d(x, w, b, ref, mixed_batch(None), silu=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)  # windows and the saved row
    assert torch.equal(ours[8], states[8])  # nobody's row


def recurrence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor) -> Tensor:
    """The rule token by token on one sequence (heads already expanded, q scaled): its
    outputs ``[n, H, Dv]``; ``s`` advanced in place."""
    out = []
    for t in range(q.shape[0]):
        s.mul_(g[t].exp()[:, None, None])
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], s))
        s.add_(k[t][:, :, None] * u[:, None, :])
        out.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(out)


@pytest.mark.parametrize("isa", ISAS)
def test_delta_prefill_equals_the_recurrence_and_the_torch_path(isa: str) -> None:
    native = module(isa)
    g = torch.Generator().manual_seed(3)
    hk, hv, dk, dv = 2, 4, 32, 48
    q = l2norm(torch.randn(ROWS, hk, dk, generator=g))
    k = l2norm(torch.randn(ROWS, hk, dk, generator=g))
    v = torch.randn(ROWS, hv, dv, generator=g)
    decay = -torch.rand(ROWS, hv, generator=g) * 0.3
    beta = torch.rand(ROWS, hv, generator=g)
    states = torch.randn(9, hv, dk, dv, generator=g) * 0.1
    ours, ref = states.clone(), states.clone()
    got = gated_delta_rule(q, k, v, decay, beta, ours, mixed_batch(native))
    want = gated_delta_rule(q, k, v, decay, beta, ref, mixed_batch(None))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours[8], states[8])
    # and the token-by-token recurrence, sequence by sequence (the saved row included)
    qe = q.repeat_interleave(hv // hk, dim=1) * dk**-0.5
    ke = k.repeat_interleave(hv // hk, dim=1)
    a = 0
    for i, (n, slot, fresh) in enumerate(MIXED):
        s = torch.zeros(hv, dk, dv) if fresh else states[slot].clone()
        rows = slice(a, a + n)
        if i == SAVE[0]:
            cut = slice(a, a + SAVE[1])
            saved = s.clone()
            recurrence(qe[cut], ke[cut], v[cut], decay[cut], beta[cut], saved)
            torch.testing.assert_close(ours[SAVE[2]], saved, atol=1e-4, rtol=1e-4)
        want_o = recurrence(qe[rows], ke[rows], v[rows], decay[rows], beta[rows], s)
        torch.testing.assert_close(got[rows], want_o, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours[slot], s, atol=1e-4, rtol=1e-4)
        a += n


@pytest.mark.parametrize("isa", ISAS)
def test_prefill_segments_out_of_range_are_refused(isa: str) -> None:
    native = module(isa)
    x, w, states = torch.zeros(4, 8), torch.zeros(8, 3), torch.zeros(2, 8, 2)
    out = torch.empty_like(x)
    for seg, msg in [
        ([0, 5, 0, 1, 5, -1], "rows out of range"),
        ([0, 4, 2, 1, 4, -1], "state slot out of range"),
        ([0, 4, 0, 1, 0, -1], "split out of range"),
    ]:
        with pytest.raises(RuntimeError, match=msg):
            native.conv_prefill(  # type: ignore[attr-defined]
                x, w, None, states, torch.tensor([seg]), out, False
            )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tiled", [False, True])
def test_deltanet_layer_native_equals_torch_ops(isa: str, tiled: bool) -> None:
    # the whole mixer on a mixed step: delta_inputs (norms, gates, the key heads' order),
    # the convolution's SiLU in its kernels, decode and prefill rows, gated_norm
    native = module(isa)
    torch.manual_seed(4)
    layer = GatedDeltaNet(64, 2, 4, 32, 48, 4, 1e-6, tiled_values=tiled)
    for p in layer.parameters():
        p.data = torch.randn_like(p) * (0.2 if p.dim() == 2 else 1.0)
    layer.A_log.data = torch.rand(4).log()
    x = torch.randn(ROWS, 64)
    conv, rec = torch.randn(9, layer.conv_dim, 3), torch.randn(9, 4, 32, 48) * 0.1
    ours = (conv.clone(), rec.clone())
    ref = (conv.clone(), rec.clone())
    got = layer(x, ours, mixed_batch(native))
    want = layer(x, ref, mixed_batch(None))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
