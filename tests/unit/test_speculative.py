"""Speculative decoding's pure parts: the proposers, the acceptance walk, the drafting
policy and the config."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.config import SpeculativeConfig, speculative_config
from structllm.engine import speculative
from structllm.engine.core import DRAFT_STEP_COSTS
from structllm.engine.request import Request
from structllm.engine.speculative import (
    Drafter,
    NgramIndex,
    NgramProposer,
    SuffixProposer,
    accept,
    ngram_draft,
)
from structllm.protocol import SamplingParams


def req(
    rid: str, tokens: list[int], prompt_len: int | None = None, max_tokens: int = 100
) -> Request:
    r = Request(rid, tokens[: prompt_len or len(tokens)], SamplingParams(), max_tokens)
    r.token_ids += tokens[prompt_len or len(tokens) :]
    return r


def test_ngram_drafts_what_followed_the_latest_longest_match() -> None:
    p = NgramProposer(2, 4)
    # "5 6 7" occurs twice before the tail; the tail "9 5 6 7" matches the later one longer
    tokens = [5, 6, 7, 1, 2, 9, 5, 6, 7, 3, 4, 8, 9, 5, 6, 7]
    assert p.propose(req("a", tokens), 3) == [3, 4, 8]
    assert ngram_draft(tokens, 3, 2, 4) == [3, 4, 8]
    assert p.propose(req("b", [1, 2, 3, 4]), 3) == []  # no earlier occurrence


def test_ngram_index_is_incremental() -> None:
    p = NgramProposer(2, 3)
    r = req("a", [1, 2, 3, 1, 2])
    assert p.propose(r, 2) == [3, 1]
    r.token_ids += [3, 7, 1, 2]  # "3 1 2" ... now "1 2" last followed by 3 at position 6? no:
    # the tail "7 1 2" does not occur; "1 2" latest occurrence at 4..5 is followed by 3
    assert p.propose(r, 2) == ngram_draft(r.token_ids, 2, 2, 3) == [3, 7]
    p.finish(r)
    assert p.indexes == {}


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    k=st.integers(1, 6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_ngram_index_equals_the_brute_force_search(
    tokens: list[int], k: int, min_n: int, extra: int
) -> None:
    """With every candidate tried, the index finds what a scan finds; built in pieces,
    the same as built at once."""
    max_n = min_n + extra
    index = NgramIndex(min_n, max_candidates=1 << 30)
    for cut in (len(tokens) // 3, len(tokens)):
        index.extend(tokens, cut)
    m, i = index.match(tokens, tokens, max_n)
    got = tokens[i : i + k] if m else []
    assert got == ngram_draft(tokens, k, min_n, max_n)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=80), k=st.integers(1, 5))
def test_ngram_draft_continues_a_real_match(tokens: list[int], k: int) -> None:
    """With the default candidate bound: a draft always follows an earlier occurrence of
    at least the ``min_n`` tail."""
    d = NgramProposer(2, 5).propose(req("a", tokens), k)
    if d:
        tail = tokens[-2:]
        assert any(
            tokens[i - 2 : i] == tail and tokens[i : i + len(d)] == d for i in range(2, len(tokens))
        )


def test_suffix_drafts_from_an_earlier_request() -> None:
    p = SuffixProposer(2, 8, max_cached=2)
    first = req("1", [1, 2, 3] + [10, 11, 12, 13, 14, 15, 16], prompt_len=3)
    p.finish(first)
    now = req("2", [4, 5, 6, 12, 13])  # 12 13 occurred in request 1's output
    assert p.propose(now, 3) == [14, 15, 16]
    # its own tokens win on an equal match: "12 13" in its own history, followed by 99
    own = req("3", [12, 13, 99, 7, 12, 13])
    assert p.propose(own, 2) == [99, 7]
    for rid in ("4", "5"):  # two newer outputs push request 1 out
        p.finish(req(rid, [0, 0, 0, 30, 31, 32], prompt_len=3))
    assert p.propose(req("6", [4, 5, 6, 12, 13]), 3) == []


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accept_walks_to_the_first_difference(k: int) -> None:
    drafts = list(range(10, 10 + k))
    assert accept([*drafts, 99], drafts) == [*drafts, 99]  # all accepted, plus one
    assert accept([77, *drafts], drafts) == [77]  # none
    for j in range(k):  # accepted up to j, the sampled token at j differs
        rows = drafts[:j] + [50] + drafts[j + 1 :] + [99]
        assert accept(rows, drafts) == [*drafts[:j], 50]
    assert accept([5], []) == [5]


def test_drafter_policy() -> None:
    cfg = SpeculativeConfig(
        num_speculative_tokens=4, disable_by_batch_size=2, min_acceptance=0.5, acceptance_window=4
    )
    d = Drafter(cfg)
    r = req("a", [1, 2, 3, 4, 5, 6, 1, 2], prompt_len=6, max_tokens=6)
    assert d.drafts(r, room=10, num_running=1) == [3, 4, 5]  # max_tokens 6, 2 out: 3 drafts + 1
    assert d.drafts(r, room=1, num_running=1) == [3]  # the step's budget
    assert d.drafts(r, room=10, num_running=3) == []  # above disable_by_batch_size
    d.record(r, [3, 4, 5], [3, 9])
    assert (d.stats.num_drafts, d.stats.num_draft_tokens, d.stats.num_accepted_tokens) == (1, 3, 1)
    assert d.stats.accepted_per_pos == [1, 0, 0, 0]
    d.record(r, [3, 4, 5], [8])  # 1 of 6 accepted: below 0.5 over the window
    assert d.drafts(r, room=10, num_running=1) == []
    assert r.spec_resume_at == r.num_output_tokens + 16


def test_config_from_json_and_errors() -> None:
    c = speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert c == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4)
    assert speculative_config({"method": "suffix"}) == SpeculativeConfig(method="suffix")
    assert speculative_config(None) is None
    assert speculative_config('{"method": "none"}') == SpeculativeConfig(method="none")  # off
    for bad, words in [
        ('{"method": "eagle"}', "method"),
        ("{nope", "JSON"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"lookahead": 1}, "lookahead"),
    ]:
        with pytest.raises(ValueError, match=words):
            speculative_config(bad)
    assert speculative.make_proposer(SpeculativeConfig(method="suffix")).__class__ is SuffixProposer


COST = (1.0, 1.2, 1.45, 1.6, 2.0, 2.2, 2.4, 2.6)  # core.DRAFT_STEP_COST's shape


def test_draft_length_from_acceptance_and_step_cost() -> None:
    best = speculative.best_draft_length
    assert best(0.97, 7, 1, COST) == 7  # nearly all accepted: the longest chunk
    assert best(0.75, 7, 1, COST) == 3  # 4 rows, before the 5-row step's jump
    assert best(0.5, 7, 1, COST) == 1
    assert best(0.15, 7, 1, COST) == 0  # (1 + 0.15) / 1.2 < 1: no draft pays
    assert best(0.97, 3, 1, COST) == 3  # num_speculative_tokens / the budget's room
    assert best(0.97, 7, 7, COST) == 1  # rows past the table are not served
    assert best(0.97, 7, 8, COST) == 0
    assert best(0.6, 7, 4, COST) == 0  # 4 running decodes: one draft costs 1.25x
    # the rule itself: the k that maximises expected tokens per cost
    for alpha in (0.1, 0.3, 0.6, 0.8, 0.9, 0.99):
        for rows in (1, 2, 4):
            k = best(alpha, 7, rows, COST)
            rate = [
                (rows - 1 + speculative.expected_tokens(alpha, j)) / COST[rows + j - 1]
                for j in range(len(COST) - rows + 1)
            ]
            assert rate[k] == max(rate)


def test_safe_draft_length_bounds_a_rejected_chunk() -> None:
    safe = speculative.safe_draft_length
    assert speculative.REJECT_COST == 1.5
    assert safe(1, COST) == 2  # 3 rows cost 1.45x a 1-row step; 4 rows 1.6x
    assert safe(1, DRAFT_STEP_COSTS["avx2"]) == 1  # the AVX2 table: 3 rows cost > 1.5x
    assert safe(2, COST) == 2  # 4 rows at 1.6 <= 1.5 * 1.2
    assert safe(8, COST) == 0  # the table's end


def test_drafts_beyond_the_safe_length_need_long_alpha() -> None:
    """Below LONG_ALPHA a request's chunk is capped where its wholesale rejection costs
    at most REJECT_COST plain steps (the inter-token latency's tail); above it the
    throughput rule alone decides."""
    d = Drafter(SpeculativeConfig())
    d.step_cost = COST
    r = req("a", list(range(20)) * 3, prompt_len=20, max_tokens=200)
    est = d.estimates["a"] = speculative.DraftEstimate()
    est.hits, est.trials = 3.0, 3.5  # alpha 0.778: the rule alone would draft 3
    assert est.alpha < speculative.LONG_ALPHA
    assert speculative.best_draft_length(est.alpha, 7, 1, COST) == 3
    assert len(d.drafts(r, room=10, num_running=1)) == 2
    est.hits, est.trials = 9.0, 9.5  # alpha 0.95
    assert len(d.drafts(r, room=10, num_running=1)) == 7


def test_adaptive_drafter_lengthens_shortens_and_pauses() -> None:
    d = Drafter(SpeculativeConfig())
    d.step_cost = COST
    tokens = list(range(20)) * 3  # repeats: the proposer always has 7+ tokens to offer
    r = req("a", tokens, prompt_len=20, max_tokens=200)
    lengths = []
    for _ in range(4):  # every draft accepted: longer and longer chunks
        drafts = d.drafts(r, room=10, num_running=1)
        lengths.append(len(drafts))
        d.record(r, drafts, [*drafts, 0])
    assert lengths[0] == 1 and lengths[-1] == 7 and lengths == sorted(lengths)
    assert d.drafts(r, room=10, num_running=2, rows=8) == []  # a full step: none
    n = 0
    while drafts := d.drafts(r, room=10, num_running=1):  # every draft rejected
        d.record(r, drafts, [-1])
        n += 1
        assert n < 10
    assert r.spec_resume_at == r.num_output_tokens + speculative.PAUSE_MIN
    r.token_ids += list(range(speculative.PAUSE_MIN))  # the pause's tokens
    assert len(d.drafts(r, room=10, num_running=1)) == 1  # from the prior again
    d.record(r, [0], [-1])
    while d.drafts(r, room=10, num_running=1):
        d.record(r, [0], [-1])
    assert r.spec_resume_at == r.num_output_tokens + 2 * speculative.PAUSE_MIN  # doubled
    d.finish(r)
    assert "a" not in d.estimates


def test_untrusted_request_drafts_only_from_a_long_match() -> None:
    """A request whose estimate is below TRUSTED_ALPHA (a fresh one: the prior's is
    below it) drafts only from a match of MIN_MATCH tokens (short matches on open text
    are rejected half the time); one whose drafts were accepted, from any match."""
    d = Drafter(SpeculativeConfig())
    d.step_cost = COST
    short = [1, 2, 50, 60, 70, 80, 1, 2]  # the tail "1 2" matched: 2 tokens
    long_ = [1, 2, 3, 4, 5, 50, 60, 70, 80, 1, 2, 3, 4, 5]  # "1 2 3 4 5": 5 tokens
    assert speculative.MIN_MATCH == 5
    assert speculative.PRIOR_HITS / speculative.PRIOR_TRIALS < speculative.TRUSTED_ALPHA
    r = req("a", short, prompt_len=6)
    assert d.drafts(r, room=10, num_running=1) == []  # fresh, short match: no drafts
    assert r.spec_resume_at == 0  # no pause: it waits for a longer match
    g = req("b", long_, prompt_len=12)
    assert d.drafts(g, room=10, num_running=1) == [50]  # fresh, long match: the prior's k=1
    d.record(g, [50], [7])  # rejected
    assert d.estimates["b"].alpha < speculative.TRUSTED_ALPHA
    assert d.drafts(g, room=10, num_running=1) == [50]  # a long match still drafts
    d.record(g, [50], [50, 0])
    d.record(g, [50], [50, 0])  # accepted twice: trusted
    assert d.estimates["b"].alpha >= speculative.TRUSTED_ALPHA
    d.estimates["s"] = d.estimates["b"]  # a request as trusted, at a 2-token match
    assert d.drafts(req("s", short, prompt_len=6), room=10, num_running=1) != []
    # without a cost table (fixed length) the gate does not apply
    fixed = Drafter(SpeculativeConfig())
    assert fixed.drafts(req("c", short, prompt_len=6), room=10, num_running=1) == short[2:]


def test_match_gate_is_capped_by_the_longest_match_looked_for() -> None:
    """With ``prompt_lookup_max`` below MIN_MATCH the gate asks for the longest match the
    proposer can report, so untrusted requests still draft from their best matches."""
    d = Drafter(SpeculativeConfig(prompt_lookup_max=3))
    d.step_cost = COST
    assert d.min_match == 3
    r = req("a", [1, 2, 3, 50, 60, 1, 2, 3], prompt_len=6)
    assert d.drafts(r, room=10, num_running=1) == [50]
    assert Drafter(SpeculativeConfig()).min_match == speculative.MIN_MATCH


def test_step_cost_table_follows_the_kernel_isa() -> None:
    """The drafter's cost table is the one measured for the ISA the block kernels are
    built for: 5 rows on AVX2 (its row kernel's limit), 8 on AVX-512."""
    import os
    import subprocess
    import sys

    code = (
        "from structllm.engine import core; from structllm.kernels.cpu_ext import best_isa; "
        "print(best_isa(), len(core.DRAFT_STEP_COST), core.DRAFT_STEP_ROWS, "
        "core.DRAFT_STEP_COST == core.DRAFT_STEP_COSTS[best_isa() or 'avx2'])"
    )
    env = {**os.environ, "STRUCTLLM_CPU_ISA": "avx2"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[1:] == ["5", "5", "True"] and out[0] in ("avx2", "None")
    from structllm.engine import core

    assert [len(t) for t in core.DRAFT_STEP_COSTS.values()] == [8, 5]
    for table in core.DRAFT_STEP_COSTS.values():  # 1 row is the unit; more rows cost more
        assert table[0] == 1.0 and list(table) == sorted(table)
