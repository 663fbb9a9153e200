"""The recurrent layers' native decode steps (``cpu_recurrent.cpp``) against the torch
path they replace (``recurrent.causal_conv1d``, ``deltanet.gated_delta_rule``), on both
ISA builds: the same outputs and the same states left in every slot, fresh sequences
(whose slots hold another sequence's values) included, other slots untouched."""

from __future__ import annotations

import pytest
import torch

from structllm.kernels import cpu_ext
from structllm.kernels.attention import AttentionMetadata
from structllm.model.deltanet import gated_delta_rule, l2norm
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
