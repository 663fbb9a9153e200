"""The torch paged-attention references against textbook dense attention."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from structllm.kernels import reference
from structllm.kernels.attention import (
    AttentionMetadata,
    CpuAttention,
    TorchAttention,
    attend,
    attention,
)
from tests.support.attention import paged_setup


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize(("h", "hkv", "d"), [(4, 4, 64), (9, 3, 64), (16, 2, 128)])
def test_decode_matches_dense(bs: int, h: int, hkv: int, d: int) -> None:
    lens = [1, 17, bs, 3 * bs + 5]
    kc, vc, bt, dense = paged_setup(lens, hkv, d, bs)
    q = torch.randn(len(lens), h, d)
    out = reference.decode_attention(q, kc, vc, bt, torch.tensor(lens), d**-0.5, max(lens))
    for i, (k, v) in enumerate(dense):
        want = reference.dense_causal_attention(q[i : i + 1], k, v, d**-0.5)
        torch.testing.assert_close(out[i : i + 1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize(("h", "hkv"), [(8, 8), (9, 3), (8, 1)])
def test_prefill_with_cached_prefix_matches_dense(bs: int, h: int, hkv: int) -> None:
    d = 64
    lens = [5, 40, 2 * bs + 1]
    q_lens = [5, 7, 1]  # a whole prompt, a chunk after 33 cached tokens, a single token
    kc, vc, bt, dense = paged_setup(lens, hkv, d, bs)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], h, d)
    out = reference.prefill_attention(q, kc, vc, bt, starts, lens, d**-0.5)
    for i, (k, v) in enumerate(dense):
        want = reference.dense_causal_attention(q[starts[i] : starts[i + 1]], k, v, d**-0.5)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], want, atol=1e-5, rtol=1e-5)


def test_prefill_uses_fresh_kv_when_nothing_is_cached() -> None:
    kc, vc, bt, dense = paged_setup([12], 2, 64, 16)
    k, v = dense[0]
    q = torch.randn(12, 4, 64)
    via_cache = reference.prefill_attention(q, kc, vc, bt, [0, 12], [12], 0.125)
    direct = reference.prefill_attention(q, kc * 0, vc * 0, bt, [0, 12], [12], 0.125, k, v)
    torch.testing.assert_close(direct, via_cache, atol=1e-6, rtol=1e-6)


def test_store_kv_writes_only_the_given_slots() -> None:
    kc, vc = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    k, v = torch.ones(3, 2, 8), torch.full((3, 2, 8), 2.0)
    reference.store_kv(k, v, kc, vc, torch.tensor([0, 17, 63]))
    assert kc.sum() == 3 * 16 and vc.sum() == 2 * 3 * 16
    assert kc[1, 1].sum() == 16 and kc[3, 15].sum() == 16


def test_mixed_batch_through_the_backend() -> None:
    """Decodes first, then prefill chunks, as the runner lays them out."""
    bs, h, hkv, d = 16, 6, 2, 64
    ctx = [9, 30, 20, 45]  # context after the step
    q_lens = [1, 1, 20, 12]  # two decodes, a fresh prompt, a chunk after 33 cached
    kc, vc, bt, dense = paged_setup(ctx, hkv, d, bs)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], h, d)
    k_new = torch.cat([dense[i][0][ctx[i] - q_lens[i] :] for i in range(4)])
    v_new = torch.cat([dense[i][1][ctx[i] - q_lens[i] :] for i in range(4)])
    slots = torch.tensor(
        [
            bt[i, p // bs].item() * bs + p % bs
            for i in range(4)
            for p in range(ctx[i] - q_lens[i], ctx[i])
        ]
    )
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=bt,
        seq_lens=torch.tensor(ctx, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_list=ctx,
        query_start_list=starts,
        num_decodes=2,
        max_seq_len=max(ctx),
    )
    out = attention(TorchAttention(), q, k_new, v_new, kc, vc, meta, d**-0.5)
    for i, (k, v) in enumerate(dense):
        want = reference.dense_causal_attention(q[starts[i] : starts[i + 1]], k, v, d**-0.5)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (16, 0.0), (0, 2.0), (7, 3.0)])
def test_window_and_softcap_match_dense(window: int, softcap: float) -> None:
    """Sliding windows shorter and longer than a block, soft-capped scores: decodes and
    prefill chunks (fresh, after a cached prefix) through the backend."""
    bs, h, hkv, d = 16, 6, 2, 64
    lens, q_lens = [9, 50, 20, 45], [1, 1, 20, 12]
    kc, vc, bt, dense = paged_setup(lens, hkv, d, bs)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_tables=bt,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_list=lens,
        query_start_list=starts,
        num_decodes=2,
        max_seq_len=max(lens),
    )
    q = torch.randn(starts[-1], h, d)
    k_new = torch.cat([dense[i][0][lens[i] - q_lens[i] :] for i in range(4)])
    v_new = torch.cat([dense[i][1][lens[i] - q_lens[i] :] for i in range(4)])
    impl = TorchAttention()
    out = torch.cat(
        [
            impl.decode(q[:2], kc, vc, meta, 0.125, window, softcap),
            impl.prefill(q[2:], k_new[2:], v_new[2:], kc, vc, meta, 0.125, window, softcap),
        ]
    )
    for i, (k, v) in enumerate(dense):
        rows = slice(starts[i], starts[i + 1])
        want = reference.dense_causal_attention(q[rows], k, v, 0.125, window, softcap)
        torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)


class CausalOnly(TorchAttention):
    """A backend whose prefill knows nothing of ``ahead`` (as Triton's)."""

    def prefill(  # type: ignore[no-untyped-def]
        self, q, k, v, k_cache, v_cache, meta, scale, window=0, softcap=0.0, sinks=None, chunk=0
    ):
        return super().prefill(
            q,
            k,
            v,
            k_cache,
            v_cache,
            replace(meta, ahead=None),
            scale,
            window,
            softcap,
            sinks,
            chunk,
        )


@pytest.mark.parametrize("backend", ["torch", "cpu", "causal-only"])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (5, 0.0), (0, 2.0), (7, 3.0)])
def test_rows_that_see_ahead_match_dense(backend: str, window: int, softcap: float) -> None:
    """Rows that also see keys past their own position (an image's tokens, Gemma 3):
    a decode, a fresh chunk with an image inside, a chunk after a cached prefix that
    starts inside an image (a prefix-cache hit) and holds another, a text chunk, through
    ``attend``: the reference, the C++ kernel (its own K layout), and a backend without
    the rule, whose image chunks ``prefill_with_ahead`` recomputes by the reference."""
    from structllm.kernels import cpu_ext

    impl: TorchAttention = CausalOnly() if backend == "causal-only" else TorchAttention()
    if backend == "cpu":
        module = cpu_ext.load()
        assert module is not None, "the C++ attention kernel did not build"
        impl = CpuAttention(module)
    bs, h, hkv, d = 16, 6, 2, 64
    lens, q_lens = [30, 24, 50, 18], [1, 24, 20, 18]  # the last: text only
    # per query row: keys past its own position it sees (the rest of its image)
    aheads = [[0], [0] * 3 + list(range(9, -1, -1)) + [0] * 11, list(range(3, -1, -1))]
    aheads[2] += [0] * 6 + list(range(5, -1, -1)) + [0] * 4
    aheads.append([0] * 18)
    kc, vc, bt, dense = paged_setup(lens, hkv, d, bs, impl=impl)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    ahead = torch.tensor([a for row in aheads for a in row])
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_tables=bt,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_list=lens,
        query_start_list=starts,
        num_decodes=1,
        max_seq_len=max(lens),
        ahead=ahead,
        ahead_seqs=frozenset({1, 2}),
    )
    q = torch.randn(starts[-1], h, d)
    k_new = torch.cat([dense[i][0][lens[i] - q_lens[i] :] for i in range(4)])
    v_new = torch.cat([dense[i][1][lens[i] - q_lens[i] :] for i in range(4)])
    out = attend(impl, q, k_new, v_new, kc, vc, meta, 0.125, window, softcap)
    plain = replace(meta, ahead=None, ahead_seqs=frozenset())
    text = attend(impl, q, k_new, v_new, kc, vc, plain, 0.125, window, softcap)
    assert torch.equal(out[starts[3] :], text[starts[3] :])  # the text chunk: bit for bit
    for i, (k, v) in enumerate(dense):
        rows = slice(starts[i], starts[i + 1])
        want = reference.dense_causal_attention(
            q[rows], k, v, 0.125, window, softcap, ahead=aheads[i]
        )
        torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)
        if any(aheads[i]):  # (and differs from causal attention)
            causal = reference.dense_causal_attention(q[rows], k, v, 0.125, window, softcap)
            assert (out[rows] - causal).abs().max() > 1e-3
