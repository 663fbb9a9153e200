"""Speculative decoding through the scheduler and the KV cache manager, with a
deterministic fake model and drafts from an oracle that knows the plain output (so every
mix of accepted and rejected drafts can be forced): the output with drafts equals the
output without, for every k; the K/V a slot holds is simulated to show that the prefix
cache never holds a rejected draft and that computed positions hold committed tokens."""

from __future__ import annotations

import pytest

from structllm.config import SpeculativeConfig
from structllm.engine.kv_cache import KVCacheManager
from structllm.engine.request import Request
from structllm.engine.scheduler import Scheduler
from structllm.engine.speculative import MIN_MATCH, Drafter, accept
from structllm.protocol import SamplingParams, TokenLogprobs

EOS = 0
VOCAB = 40


def fake_next(tokens: list[int]) -> int:
    """A function of the whole history; EOS (0) now and then (1 in ~160)."""
    h = sum(t * (i + 3) for i, t in enumerate(tokens))
    t = h % VOCAB
    return t if t or (h // VOCAB) % 4 == 0 else 1 + (h // VOCAB) % (VOCAB - 1)


class Oracle:
    """Drafts the plain run's continuation, corrupted by ``mode``: "all" right, "none"
    (every draft wrong), "partial" (right up to a point that moves with the length)."""

    last_match = MIN_MATCH  # drafts as if from a long match

    def __init__(self, plain: dict[str, list[int]], mode: str) -> None:
        self.plain, self.mode = plain, mode

    def propose(self, req: Request, k: int) -> list[int]:
        truth = self.plain[req.request_id][req.num_output_tokens : req.num_output_tokens + k]
        if self.mode == "none":
            return [(t + 1) % VOCAB for t in truth]
        if self.mode == "partial":
            cut = req.num_tokens % (k + 1)
            return truth[:cut] + [(t + 1) % VOCAB for t in truth[cut:]]
        return truth

    def finish(self, req: Request) -> None:
        pass


def make_requests(max_tokens: int, stop_ids: list[int] | None = None) -> list[Request]:
    reqs = []
    for i in range(6):
        prompt = [(i * 7 + j * 5) % VOCAB or 1 for j in range(3 + 5 * i)]
        sp = SamplingParams(max_tokens=max_tokens, logprobs=1, stop_token_ids=stop_ids or [])
        reqs.append(Request(str(i), prompt, sp, max_tokens))
    return reqs


class SlotModel:
    """Runs a scheduler's steps: writes each scheduled input token into its KV slot (the
    simulated K/V) and samples with ``fake_next``, verifying drafts with ``accept``."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        bs = s.kv.block_size
        self.slots: list[int | None] = [None] * (s.kv.num_blocks * bs)
        self.drafted_steps = 0

    def step(self) -> list[str]:
        s, bs = self.s, self.s.kv.block_size
        decoding = {r.request_id for r in s.running if r.num_tokens - r.num_computed_tokens == 1}
        running = {r.request_id for r in s.running}
        out = s.schedule()
        assert out.num_tokens <= s.max_num_batched_tokens
        if not out.preempted:  # drafts never take a decoding request's own token
            assert decoding <= {r.request_id for r, _ in out.scheduled}
        cap = s.max_draft_step_tokens
        if cap is not None and any(r.draft_token_ids for r, _ in out.scheduled):
            # the running requests' tokens (a prompt admitted after them does not count)
            assert sum(n for r, n in out.scheduled if r.request_id in running) <= cap
        self.drafted_steps += any(r.draft_token_ids for r, _ in out.scheduled)
        sampled: dict[str, int | list[int]] = {}
        lps: dict[str, TokenLogprobs | list[TokenLogprobs]] = {}
        for req, n in out.scheduled:
            drafts = req.draft_token_ids
            inputs = (req.token_ids + drafts)[req.num_computed_tokens : req.num_computed_tokens + n]
            for p, t in enumerate(inputs, start=req.num_computed_tokens):
                self.slots[req.block_ids[p // bs] * bs + p % bs] = t
            if req.samples_after(n):
                rows = [fake_next(req.token_ids + drafts[:j]) for j in range(len(drafts) + 1)]
                emitted = accept(rows, drafts)
                sampled[req.request_id] = emitted if drafts else emitted[0]
                lp = [TokenLogprobs(-float(t), [t], [-float(t)]) for t in emitted]
                lps[req.request_id] = lp if drafts else lp[0]
        deltas = s.update(out, sampled, lps)
        self.check()
        return [d.request_id for d in deltas if d.finish_reason is not None]

    def check(self) -> None:
        kv, bs = self.s.kv, self.s.kv.block_size
        kv.check_invariants(self.s.running)
        for (_, tokens, _), b in kv.cached.items():  # a cached block holds its key's tokens
            assert self.slots[b * bs : (b + 1) * bs] == list(tokens), f"block {b} holds a draft"
        for r in self.s.running:  # computed positions hold the committed tokens
            got = [
                self.slots[r.block_ids[p // bs] * bs + p % bs] for p in range(r.num_computed_tokens)
            ]
            assert got == r.token_ids[: r.num_computed_tokens]
            assert len(r.block_ids) <= -(-r.num_tokens // bs), "blocks of rejected drafts kept"


def run(
    reqs: list[Request],
    drafter: Drafter | None,
    budget: int = 64,
    num_blocks: int = 64,
    max_seqs: int = 8,
    step_cap: int | None = None,
) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]], dict[str, str | None], Scheduler]:
    s = Scheduler(KVCacheManager(num_blocks, 4), max_seqs, budget, [EOS])
    s.drafter = drafter
    s.max_draft_step_tokens = step_cap
    model = SlotModel(s)
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    lps: dict[str, list[TokenLogprobs]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        s.add_request(r)
    for _ in range(10_000):
        if not s.has_work:
            break
        model.step()
    assert not s.has_work
    for r in reqs:
        out[r.request_id] = r.output_token_ids
    return out, lps, {r.request_id: r.finish_reason for r in reqs}, s


def plain(max_tokens: int, stop_ids: list[int] | None = None) -> dict[str, list[int]]:
    return run(make_requests(max_tokens, stop_ids), None)[0]


@pytest.mark.parametrize("mode", ["all", "none", "partial"])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_output_with_drafts_equals_plain(mode: str, k: int) -> None:
    want = plain(20)
    assert any(EOS in o for o in want.values()), "some request should stop on EOS"
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=k), Oracle(want, mode))
    got, _, reasons, s = run(make_requests(20), drafter)
    assert got == want
    assert reasons == run(make_requests(20), None)[2]
    st = drafter.stats
    assert st.num_drafts > 0
    if mode == "all":  # every draft is accepted (EOS and max_tokens cut the walk)
        assert st.num_accepted_tokens == st.num_draft_tokens
        # fewer steps than tokens: several tokens per step
    elif mode == "none":
        assert st.num_accepted_tokens == 0
    else:
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_stop_token_and_max_tokens_inside_an_accepted_run() -> None:
    """A stop id or ``max_tokens`` reached at an accepted draft ends the request right
    there: the later rows' tokens are not emitted."""
    for stop_ids in ([], [7, 13]):
        want = plain(9, stop_ids)
        drafter = Drafter(SpeculativeConfig(num_speculative_tokens=8), Oracle(want, "all"))
        got, _, reasons, _ = run(make_requests(9, stop_ids), drafter)
        assert got == want
        assert reasons == run(make_requests(9, stop_ids), None)[2]
        assert {len(o) for o in got.values()} - {9}, "some request should stop early"


def test_drafts_fit_the_budget_and_every_running_request_keeps_its_token() -> None:
    """Budget 10, six requests, up to 8 drafts each: every step still runs every
    decoding request's real token (SlotModel.step checks each step)."""
    want = plain(20)
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=8), Oracle(want, "all"))
    got, *_ = run(make_requests(20), drafter, budget=10)
    assert got == want
    assert drafter.stats.num_accepted_tokens > 0


def test_preemption_drops_drafts_and_output_is_unchanged() -> None:
    want = plain(20)
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), Oracle(want, "partial"))
    got, _, _, s = run(make_requests(20), drafter, num_blocks=14)
    assert s.num_preemptions > 0
    assert got == want


def test_no_drafts_above_the_batch_size_limit() -> None:
    want = plain(20)
    cfg = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=2)
    drafter = Drafter(cfg, Oracle(want, "all"))
    s = Scheduler(KVCacheManager(64, 4), 8, 64, [EOS])
    s.drafter = drafter
    model = SlotModel(s)
    for r in make_requests(20):
        s.add_request(r)
    while s.has_work:
        before = drafter.stats.num_drafts
        n = len(s.running)
        model.step()
        if n > 2:
            assert drafter.stats.num_drafts == before
    assert drafter.stats.num_drafts > 0


def test_ngram_proposer_through_the_scheduler_forgets_finished_requests() -> None:
    want = plain(20)
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    got, *_ = run(make_requests(20), drafter)
    assert got == want
    assert drafter.stats.num_drafts > 0
    assert drafter.proposer.indexes == {}  # type: ignore[attr-defined]


@pytest.mark.parametrize("cap", [2, 4, 7])
def test_drafts_keep_the_step_within_max_draft_step_tokens(cap: int) -> None:
    """The step-token cap (where verifying more rows stops being cheap): the running
    requests' tokens in a step with drafts never exceed it (SlotModel.step checks);
    output unchanged."""
    want = plain(20)
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=6), Oracle(want, "all"))
    got, *_ = run(make_requests(20), drafter, max_seqs=2, step_cap=cap)
    assert got == want
    assert drafter.stats.num_drafts > 0  # once few requests are left


class Fixed:
    """Always drafts the same tokens."""

    last_match = MIN_MATCH  # drafts as if from a long match

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, req: Request, k: int) -> list[int]:
        return self.drafts[:k]

    def finish(self, req: Request) -> None:
        pass


def test_drafts_give_their_blocks_back_before_anyone_is_preempted() -> None:
    """Four blocks of 4: two 4-token prompts take one each; at the next step A's decode
    with 4 drafts takes two more, leaving B none. A's drafts are dropped (and their
    block returned), not B preempted."""
    s = Scheduler(KVCacheManager(4, 4), 8, 64, [EOS])
    s.drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), Fixed([9, 9, 9, 9]))
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=10), 10)
    b = Request("b", [5, 6, 7, 8], SamplingParams(max_tokens=10), 10)
    s.add_request(a)
    s.add_request(b)
    model = SlotModel(s)
    model.step()  # both prompts
    out = s.schedule()
    assert out.preempted == []
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1)]
    assert a.draft_token_ids == [] and len(a.block_ids) == 2
    s.kv.check_invariants(s.running)
