"""Scheduler: continuous batching, chunked prefill, preemption, aborts (no model).

A fake model picks each next token as a function of the whole token history, so a
request's output is the same however it was batched, chunked or preempted, exactly
as greedy decoding with a real model should be.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.engine.kv_cache import KVCacheManager
from structllm.engine.request import Request, Status
from structllm.engine.scheduler import Scheduler, SchedulerOutput
from structllm.protocol import SamplingParams, TokenDelta

EOS = 0
VOCAB = 50


def fake_token(r: Request) -> int:
    return 1 + (sum(t * (i + 1) for i, t in enumerate(r.token_ids)) % (VOCAB - 1))


def make(
    num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_seqs: int = 8
) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size), max_seqs, budget, [EOS])


def request(rid: str, prompt_len: int, max_tokens: int = 6) -> Request:
    prompt = [(int(rid) * 13 + i * 7) % VOCAB or 1 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens)


def step(s: Scheduler) -> tuple[SchedulerOutput, list[TokenDelta]]:
    out = s.schedule()
    assert out.num_tokens <= s.max_num_batched_tokens
    assert len(s.running) <= s.max_num_seqs
    sampled = {r.request_id: fake_token(r) for r in out.sampling_requests()}
    return out, s.update(out, sampled)


def run_all(s: Scheduler, reqs: list[Request], max_steps: int = 10_000) -> dict[str, list[int]]:
    for r in reqs:
        s.add_request(r)
    for _ in range(max_steps):
        if not s.has_work:
            break
        step(s)
        s.kv.check_invariants(s.running)
    assert not s.has_work, "did not finish"
    return {r.request_id: r.output_token_ids for r in reqs}


def test_prefill_and_decode_share_a_step() -> None:
    s = make()
    s.add_request(request("1", 5))
    step(s)  # prefill of 1
    s.add_request(request("2", 7))
    out, _ = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("1", 1), ("2", 7)]


def test_long_prompt_is_prefilled_in_chunks_and_samples_once() -> None:
    s = make(budget=8)
    r = request("1", 20)
    s.add_request(r)
    chunks = []
    for _ in range(3):
        out, deltas = step(s)
        chunks.append(out.scheduled[0][1])
        assert (deltas != []) == (sum(chunks) == 20)
    assert chunks == [8, 8, 4]
    assert r.num_output_tokens == 1


def test_budget_is_shared_between_running_and_new_requests() -> None:
    s = make(budget=10)
    for i in range(3):
        s.add_request(request(str(i), 6))
    out, _ = step(s)
    assert [n for _, n in out.scheduled] == [6, 4]  # the second prompt is chunked


def test_max_num_seqs_limits_running() -> None:
    s = make(max_seqs=2)
    for i in range(4):
        s.add_request(request(str(i), 3))
    step(s)
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_outputs_do_not_depend_on_budget_or_pool() -> None:
    reqs = lambda: [request(str(i), 3 + 5 * i, max_tokens=12) for i in range(6)]  # noqa: E731
    reference = run_all(make(num_blocks=256, budget=512), reqs())
    chunked = run_all(make(num_blocks=256, budget=5), reqs())
    assert chunked == reference


def test_preemption_recomputes_and_gives_the_same_tokens() -> None:
    reqs = lambda: [request(str(i), 8, max_tokens=24) for i in range(4)]  # noqa: E731
    reference = run_all(make(num_blocks=256), reqs())
    s = make(num_blocks=14, block_size=4)  # 4 requests x 8 blocks at the end: cannot all fit
    tight = run_all(s, reqs())
    assert s.num_preemptions > 0
    assert tight == reference
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_newest_running_request_is_preempted_first() -> None:
    s = make(num_blocks=6, block_size=4, max_seqs=3)
    for i in range(3):
        s.add_request(request(str(i), 7, max_tokens=20))
    step(s)
    order = [r.request_id for r in s.running]
    while not s.num_preemptions:
        out, _ = step(s)
    assert out.preempted[0].request_id == order[-1]
    assert s.waiting[0].request_id == order[-1]


def test_abort_returns_blocks_and_is_idempotent() -> None:
    s = make()
    a, b = request("1", 9), request("2", 9)
    s.add_request(a)
    s.add_request(b)
    step(s)
    deltas = s.abort(["1", "1", "unknown"])
    assert [d.finish_reason for d in deltas] == ["abort"]
    assert a.status is Status.FINISHED and a.block_ids == []
    assert s.abort(["1"]) == []
    s.kv.check_invariants(s.running)


def test_abort_of_a_waiting_request() -> None:
    s = make(max_seqs=1)
    s.add_request(request("1", 4))
    s.add_request(request("2", 4))
    step(s)
    assert s.abort(["2"])[0].finish_reason == "abort"
    assert not s.waiting


def test_eos_and_max_tokens_finish_with_the_right_reason() -> None:
    s = make()
    r = request("1", 4, max_tokens=3)
    s.add_request(r)
    reasons = []
    while s.has_work:
        out, deltas = step(s)
        reasons += [d.finish_reason for d in deltas]
    assert reasons == [None, None, "length"]
    s2 = make()
    r2 = request("2", 4)
    s2.add_request(r2)
    out = s2.schedule()
    deltas = s2.update(out, {"2": EOS})
    assert deltas[0].finish_reason == "stop" and deltas[0].new_token_ids == [EOS]


def test_min_tokens_defers_eos_and_stop_token_ids() -> None:
    s = make()
    r = Request("1", [3, 4, 5], SamplingParams(max_tokens=9, min_tokens=2, stop_token_ids=[7]), 9)
    s.add_request(r)
    assert s.update(s.schedule(), {"1": EOS})[0].finish_reason is None
    assert s.update(s.schedule(), {"1": 7})[0].finish_reason is None
    d = s.update(s.schedule(), {"1": 7})[0]
    assert d.finish_reason == "stop" and d.stop_reason == 7


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "step", "abort"]), st.integers(0, 9), st.integers(1, 30)
        ),
        max_size=80,
    ),
    st.integers(4, 40),
    st.integers(1, 64),
)
def test_random_add_step_abort_keep_invariants(
    ops: list[tuple[str, int, int]], num_blocks: int, budget: int
) -> None:
    s = make(num_blocks=num_blocks, block_size=4, budget=budget, max_seqs=4)
    seen: set[str] = set()
    for op, i, n in ops:
        rid = str(i)
        if op == "add" and rid not in s.requests and rid not in seen:
            # never longer than the pool can hold alone (the engine rejects those up front)
            prompt_len = min(n, num_blocks * 4 - 8)
            if prompt_len >= 1:
                seen.add(rid)
                s.add_request(
                    request(rid, prompt_len, max_tokens=min(6, num_blocks * 4 - prompt_len))
                )
        elif op == "abort":
            s.abort([rid])
        elif op == "step":
            step(s)
        s.kv.check_invariants(s.running)
        assert all(not r.block_ids for r in s.waiting)
    for _ in range(5000):
        if not s.has_work:
            break
        step(s)
        s.kv.check_invariants(s.running)
    assert not s.has_work
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert all(c == 0 for c in s.kv.ref_cnt)


def run_pipelined(
    s: Scheduler, reqs: list[Request], depth: int, abort_at: frozenset[int] = frozenset()
) -> dict[str, list[int]]:
    """As the engine with ``depth`` pipeline stages: batches of requests not in flight
    are submitted until ``depth`` are, then the oldest completes (its tokens are only
    known then). ``abort_at``: steps after whose submissions the first request of the
    oldest batch in flight is aborted."""
    from collections import deque

    for r in reqs:
        s.add_request(r)
    flight: deque[SchedulerOutput] = deque()
    busy: set[str] = set()
    for k in range(10_000):
        if not (s.has_work or flight):
            break
        while len(flight) < depth:
            live = len(s.running) + len(s.waiting)
            out = s.schedule(busy, max(1, -(-live // depth)))
            if not out.scheduled:
                break
            ids = {r.request_id for r, _ in out.scheduled}
            assert not ids & busy, "a request in two batches in flight"
            assert not {r.request_id for r in out.preempted} & busy, (
                "an in-flight request preempted"
            )
            flight.append(out)
            busy |= ids
        out = flight.popleft()
        if k in abort_at:
            s.abort([out.scheduled[0][0].request_id])
        busy -= {r.request_id for r, _ in out.scheduled}
        # sampled from what the request was when submitted (it did not change since)
        sampled = {r.request_id: fake_token(r) for r in out.sampling_requests()}
        s.update(out, sampled)
        s.kv.check_invariants(s.running)
    assert not s.has_work and not flight, "did not finish"
    return {r.request_id: r.output_token_ids for r in reqs}


def test_pipelined_batches_give_the_same_tokens_with_preemption_and_aborts() -> None:
    reqs = lambda: [request(str(i), 3 + 5 * i, max_tokens=16) for i in range(6)]  # noqa: E731
    reference = run_all(make(num_blocks=256), reqs())
    roomy = make(num_blocks=256)
    assert run_pipelined(roomy, reqs(), depth=2) == reference
    tight = make(num_blocks=20, block_size=4, budget=12)
    assert run_pipelined(tight, reqs(), depth=3) == reference
    assert tight.num_preemptions > 0
    assert tight.kv.num_free_blocks == tight.kv.num_blocks
    # aborted while its batch is in flight: that batch's result is dropped for it
    s = make(num_blocks=256)
    got = run_pipelined(s, reqs(), depth=2, abort_at=frozenset({2, 5}))
    aborted = {rid for rid, out in got.items() if len(out) < 16}
    assert len(aborted) == 2
    assert all(got[rid] == reference[rid][: len(got[rid])] for rid in aborted)
    assert {k: got[k] for k in got if k not in aborted} == {
        k: reference[k] for k in got if k not in aborted
    }
    assert s.kv.num_free_blocks == s.kv.num_blocks
