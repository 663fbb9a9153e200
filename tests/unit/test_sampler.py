"""Sampler: each parameter's effect, seeds, logprobs, broken logits."""

from __future__ import annotations

import math

import pytest
import torch

from structllm.engine.request import Request
from structllm.engine.sampler import Sampler, argmax_rows
from structllm.protocol import SamplingParams

V = 32


def r(prompt: list[int] | None = None, out: list[int] | None = None, **sp: object) -> Request:
    req = Request("x", prompt or [1, 2, 3], SamplingParams(max_tokens=100, **sp), 100)  # type: ignore[arg-type]
    req.token_ids += out or []
    return req


def logits_row(*pairs: tuple[int, float], base: float = 0.0) -> torch.Tensor:
    row = torch.full((V,), float(base))
    for i, v in pairs:
        row[i] = v
    return row


def sample(reqs: list[Request], rows: list[torch.Tensor], seed: int = 0) -> list[int]:
    return Sampler([0], seed)(torch.stack(rows), reqs)[0]


def test_greedy_is_argmax() -> None:
    assert sample([r(temperature=0)], [logits_row((5, 3.0), (7, 2.0))]) == [5]


def test_top_k_one_is_greedy_even_when_hot() -> None:
    toks = {
        sample([r(temperature=5.0, top_k=1)], [logits_row((9, 1.0))], seed=s)[0] for s in range(20)
    }
    assert toks == {9}


def test_temperature_spreads_choices() -> None:
    row = logits_row((3, 1.0), (4, 1.0), (5, 1.0), base=-30.0)
    toks = {sample([r(temperature=1.0)], [row.clone()], seed=s)[0] for s in range(40)}
    assert toks == {3, 4, 5}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # probabilities ~ 0.5, 0.3, 0.2 (and ~0 elsewhere): top_p=0.6 keeps the first two
    row = logits_row((1, math.log(0.5)), (2, math.log(0.3)), (3, math.log(0.2)), base=-50.0)
    toks = {sample([r(top_p=0.6)], [row.clone()], seed=s)[0] for s in range(80)}
    assert toks == {1, 2}


def test_min_p_drops_unlikely_tokens() -> None:
    row = logits_row((1, math.log(0.6)), (2, math.log(0.35)), (3, math.log(0.05)), base=-50.0)
    toks = {sample([r(min_p=0.1)], [row.clone()], seed=s)[0] for s in range(80)}
    assert toks == {1, 2}


def test_repetition_penalty_discourages_seen_tokens() -> None:
    row = logits_row((4, 2.0), (6, 1.5))
    assert sample([r(prompt=[4], temperature=0, repetition_penalty=2.0)], [row]) == [6]


def test_presence_and_frequency_penalties_use_output_tokens_only() -> None:
    row = logits_row((4, 2.0), (6, 1.5))
    assert sample([r(prompt=[4], temperature=0, presence_penalty=1.0)], [row.clone()]) == [4]
    assert sample([r(out=[4], temperature=0, presence_penalty=1.0)], [row.clone()]) == [6]
    assert sample([r(out=[4], temperature=0, frequency_penalty=0.3)], [row.clone()]) == [4]
    assert sample([r(out=[4, 4], temperature=0, frequency_penalty=0.3)], [row.clone()]) == [6]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    row = logits_row((0, 9.0), (7, 8.0), (3, 1.0))
    assert sample([r(temperature=0, min_tokens=1, stop_token_ids=[7])], [row.clone()]) == [3]
    assert sample([r(out=[5], temperature=0, min_tokens=1, stop_token_ids=[7])], [row.clone()]) == [
        0
    ]


def test_seeded_request_ignores_batch_composition() -> None:
    torch.manual_seed(1)
    rows = [torch.randn(V) for _ in range(4)]
    alone = [sample([r(seed=42)], [rows[0].clone()], seed=s)[0] for s in range(3)]
    assert len(set(alone)) == 1  # engine seed does not matter
    mixed = sample(
        [r(), r(seed=42), r(temperature=0)],
        [rows[1].clone(), rows[0].clone(), rows[2].clone()],
        seed=9,
    )
    assert mixed[1] == alone[0]


def test_seed_sequence_depends_on_the_output_position() -> None:
    torch.manual_seed(2)
    row = torch.randn(V) * 0.1
    draws = [sample([r(out=[1] * k, seed=7)], [row.clone()])[0] for k in range(12)]
    assert len(set(draws)) > 1


def test_unseeded_draws_vary() -> None:
    s = Sampler([0], 0)
    row = torch.zeros(1, V)
    toks = {s(row.clone(), [r()])[0][0] for _ in range(30)}
    assert len(toks) > 5


def test_logprobs_are_raw_log_softmax_with_top_n() -> None:
    row = logits_row((1, 2.0), (2, 1.0))
    req = r(temperature=0, logprobs=2, repetition_penalty=5.0, prompt=[1])
    toks, lps = Sampler([0], 0)(row[None].clone(), [req])
    expected = torch.log_softmax(row, -1)
    lp = lps[0]
    assert lp is not None
    assert toks == [2]  # penalty moved the choice...
    assert lp.logprob == pytest.approx(float(expected[2]))  # ...but logprobs are of the raw logits
    assert lp.top_ids == [1, 2]
    assert lp.top_logprobs == pytest.approx([float(expected[1]), float(expected[2])])


def test_nan_row_does_not_take_the_batch_down() -> None:
    good = logits_row((5, 3.0))
    nan = torch.full((V,), float("nan"))
    partial = logits_row((6, float("inf")), (8, float("nan")))
    toks, _ = Sampler([0], 0)(
        torch.stack([good, nan, partial]), [r(temperature=0), r(), r(temperature=0)]
    )
    assert toks[0] == 5 and 0 <= toks[1] < V and toks[2] == 6


def test_native_greedy_rows_are_the_checked_paths_tokens() -> None:
    """With the fused CPU ops (``cpu_layer.cpp``), a step of plain greedy rows is picked
    in one native call: each row's token is the one the torch path picks (ties, -inf
    entries); a row with a NaN, +inf or nothing finite is left to the torch path
    (-1), so broken rows still get its tokens. Rows that want more (logprobs, a bias,
    penalties, a sampled row) never take the native call."""
    from structllm.kernels import cpu_ext

    ops = cpu_ext.load_layer()
    if ops is None:
        pytest.skip("the fused CPU ops need AVX2/FMA/F16C (and a compiler)")
    calls: list[list[int]] = []

    class Native:
        def greedy_rows(self, x: torch.Tensor) -> list[int]:
            calls.append(ops.greedy_rows(x))
            return calls[-1]

    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 49152, generator=g)
    x[1, 40000] = x[1, 7] = 9.0  # tied maxima: the first
    x[2, :100] = float("-inf")  # some -inf, a finite maximum
    x[3] = 3.0  # all tied
    x[4, 49151] = 50.0  # the very last
    x[5, 10] = float("nan")
    x[6, 7] = x[6, 9] = float("inf")  # (the torch path: the first +inf)
    x[7] = float("-inf")  # nothing finite (the torch path: a uniform row, token 0)
    greedy = [r(temperature=0) for _ in range(8)]
    expected = Sampler([0], 0)(x.clone(), greedy)[0]
    assert expected[:5] == x[:5].argmax(dim=-1).tolist()
    native = Sampler([0], 0, Native())
    assert native(x[:5].clone(), greedy[:5])[0] == expected[:5]
    assert calls == [expected[:5]]  # one call, all rows decided
    assert native(x.clone(), greedy)[0] == expected  # broken rows: the torch path
    assert calls[-1][5:] == [-1, -1, -1]
    for vocab in (1000, 37, 5):  # tails shorter than a vector
        y = torch.randn(4, vocab, generator=g)
        y[1, vocab - 1] = 9.0  # the last (in the tail)
        y[2, -2:] = 9.0  # tied in the tail
        y[3, vocab - 1] = float("nan")
        assert ops.greedy_rows(y)[:3] == y[:3].argmax(dim=-1).tolist()
        assert ops.greedy_rows(y)[3] == -1
    calls.clear()
    for other in (
        r(temperature=0, logprobs=0),
        r(temperature=0, logit_bias={3: 1.0}),
        r(temperature=0, repetition_penalty=1.2),
        r(temperature=0, min_tokens=5),
        r(temperature=1.0),
    ):
        native(x[:2].clone(), [greedy[0], other])
    assert calls == []


@pytest.mark.parametrize("vocab", [49152, 1000, 96, 37])
def test_argmax_rows_matches_torch_argmax(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(7, vocab, generator=g)
    x[1] = 3.0  # a constant row: every position ties, the first wins
    x[2, vocab // 2] = x[2, vocab - 1] = 100.0  # ties in different chunks
    x[3] = float("-inf")
    x[4, vocab // 3] = float("nan")  # NaN counts as the maximum, as in torch
    x[4, vocab - 2] = float("nan")
    x[5, -1] = float("inf")
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()
    assert argmax_rows(x[2:5]).tolist() == x[2:5].argmax(dim=-1).tolist()  # a row slice


def test_argmax_rows_of_no_rows() -> None:
    assert argmax_rows(torch.empty(0, 49152)).shape == (0,)


def test_small_batches_sample_on_one_thread_and_restore_the_count() -> None:
    """Up to SINGLE_THREAD_ROWS rows the sampler's torch ops run on one thread (no
    OpenMP join on a shared machine); the thread count is put back, also on error, and
    larger batches keep torch's threads."""
    from structllm.engine import sampler as sm

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: list[int] = []
        with sm._one_thread(sm.SINGLE_THREAD_ROWS, torch.device("cpu")):
            seen.append(torch.get_num_threads())
        with sm._one_thread(sm.SINGLE_THREAD_ROWS + 1, torch.device("cpu")):
            seen.append(torch.get_num_threads())
        assert seen == [1, 2]
        with pytest.raises(RuntimeError), sm._one_thread(1, torch.device("cpu")):
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
        assert sample([r(temperature=0)] * 2, [logits_row((5, 3.0))] * 2) == [5, 5]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
