"""The priority scheduling policy (``Scheduler(policy="priority")``), no model.

As in ``test_scheduler``, a fake model picks each next token from the whole token
history, so a request's output does not depend on how it was batched, chunked or
preempted: a preempted request must finish with the tokens of an uninterrupted run.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.config import SpeculativeConfig
from structllm.engine.kv_cache import KVCacheManager
from structllm.engine.request import Request
from structllm.engine.scheduler import Scheduler, SchedulerOutput
from structllm.engine.speculative import MIN_MATCH, Drafter
from structllm.protocol import SamplingParams

VOCAB = 50


def fake_token(r: Request) -> int:
    return 1 + (sum(t * (i + 1) for i, t in enumerate(r.token_ids)) % (VOCAB - 1))


def make(
    policy: str = "priority",
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_seqs: int = 8,
) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size), max_seqs, budget, [0], None, policy)


def request(rid: str, prompt_len: int, priority: int = 0, max_tokens: int = 8) -> Request:
    prompt = [(len(rid) * 31 + ord(rid[-1]) * 13 + i * 7) % VOCAB or 1 for i in range(prompt_len)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, sp, max_tokens, priority=priority)


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    assert out.num_tokens <= s.max_num_batched_tokens
    assert len(s.running) <= s.max_num_seqs
    s.update(out, {r.request_id: fake_token(r) for r in out.sampling_requests()})
    s.kv.check_invariants(s.running)
    return out


def ids(reqs: list[Request]) -> list[str]:
    return [r.request_id for r in reqs]


def finish(s: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not s.has_work:
            return outs
        outs.append(step(s))
    raise AssertionError("did not finish")


def alone(req: Request) -> list[int]:
    """``req``'s output from a run of its own (a copy: same id, prompt, limits)."""
    s = make("fcfs")
    copy = Request(req.request_id, req.token_ids[: req.prompt_len], req.sampling, req.max_tokens)
    s.add_request(copy)
    finish(s)
    return copy.output_token_ids


def test_an_urgent_arrival_takes_a_full_batch_s_seat_within_one_step() -> None:
    s = make(max_seqs=2)
    low = [request("low0", 6), request("low1", 6)]
    for r in low:
        s.add_request(r)
    step(s)
    step(s)  # both decoding: the batch is full
    urgent = request("urgent", 5, priority=-1)
    s.add_request(urgent)
    out = step(s)
    assert ids(out.displaced) == ["low1"]  # the later of the two equals
    assert "urgent" in ids([r for r, _ in out.scheduled])
    assert urgent.num_output_tokens == 1  # its prompt ran whole and sampled
    assert s.kv.lookup(low[1])  # its blocks stay in the prefix cache for its resumption
    outs = finish(s)
    assert sum(len(o.displaced) + len(o.preempted) for o in outs) == 0  # no ping-pong
    for r in [*low, urgent]:
        assert r.output_token_ids == alone(r), r.request_id
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_fcfs_never_preempts_for_an_arrival() -> None:
    s = make("fcfs", max_seqs=2)
    for r in (request("low0", 6), request("low1", 6)):
        s.add_request(r)
    step(s)
    s.add_request(request("urgent", 5))
    out = step(s)
    assert out.displaced == [] and ids([r for r, _ in out.scheduled]) == ["low0", "low1"]


def test_equal_priorities_stay_first_come_first_served() -> None:
    def run(policy: str) -> list[list[tuple[str, int]]]:
        s = make(policy, num_blocks=12, budget=10, max_seqs=3)
        reqs = [
            request(f"r{i}", 4 + 3 * i, priority=7 if policy == "priority" else 0) for i in range(6)
        ]
        steps = []
        for k in range(200):
            if k < len(reqs):  # one arrival per step
                s.add_request(reqs[k])
            if not s.has_work:
                break
            out = step(s)
            steps.append([(r.request_id, n) for r, n in out.scheduled])
        assert not s.has_work
        assert s.num_preemptions > 0  # the pool is short: requeued ones keep their place too
        return steps

    fcfs, priority = run("fcfs"), run("priority")
    assert priority == fcfs


def test_waiting_requests_start_by_priority_then_arrival() -> None:
    s = make(max_seqs=1, budget=64)
    s.add_request(request("first", 3, priority=0, max_tokens=1))
    step(s)  # it runs and finishes: the others wait in the queue meanwhile
    for rid, prio in (("a", 3), ("b", 1), ("c", 3), ("d", 1), ("e", 2)):
        s.add_request(request(rid, 3, priority=prio, max_tokens=1))
    assert ids(list(s.waiting)) == ["b", "d", "e", "a", "c"]
    started = []
    for out in finish(s):
        started += [r.request_id for r, _ in out.scheduled]
    assert started == ["b", "d", "e", "a", "c"]


def test_memory_pressure_preempts_the_least_urgent_running_request() -> None:
    # three requests admitted together (most urgent first), then their decodes outgrow
    # the pool: the victims are the largest priority, then the latest of equals
    s = make(num_blocks=9, block_size=4, max_seqs=4)
    for rid, prio in (("p2-early", 2), ("p0", 0), ("p2-late", 2)):
        s.add_request(request(rid, 7, priority=prio, max_tokens=20))
    step(s)
    assert ids(s.running) == ["p0", "p2-early", "p2-late"]
    victims: list[str] = []
    while not victims:
        victims = ids(step(s).preempted)
    assert victims[0] == "p2-late"
    outs = finish(s)
    later = [v.request_id for o in outs for v in o.preempted]
    assert "p0" not in later  # the most urgent is never a victim while others run


def test_an_urgent_arrival_preempts_for_blocks_when_seats_are_free() -> None:
    s = make(num_blocks=8, block_size=4, budget=64, max_seqs=8)
    low = request("low", 24, priority=5, max_tokens=4)  # 6 of the 8 blocks, then a 7th
    s.add_request(low)
    step(s)
    urgent = request("urgent", 8, priority=1, max_tokens=4)  # 2 blocks + 1: does not fit
    s.add_request(urgent)
    out = step(s)
    assert ids(out.displaced) == ["low"]
    assert ids([r for r, _ in out.scheduled]) == ["urgent"]
    finish(s)
    assert low.output_token_ids == alone(low)
    assert urgent.output_token_ids == alone(urgent)


def test_equal_priority_never_preempts_a_running_request() -> None:
    s = make(num_blocks=8, block_size=4, max_seqs=1)
    s.add_request(request("a", 6, priority=3, max_tokens=10))
    step(s)
    s.add_request(request("b", 6, priority=3))
    s.add_request(request("c", 6, priority=4))
    outs = finish(s)
    assert all(o.displaced == [] and o.preempted == [] for o in outs)


def test_a_less_urgent_prefill_waits_while_an_urgent_request_waits() -> None:
    # budget 8: the low request's long prompt would take every token of every step
    s = make(budget=8, max_seqs=4)
    low = request("low", 40, priority=2)
    s.add_request(low)
    step(s)
    urgent = request("urgent", 6, priority=0)
    s.add_request(urgent)
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("urgent", 6)]
    out = step(s)  # then both: the urgent decode first, the prefill with the rest
    assert [(r.request_id, n) for r, n in out.scheduled] == [("urgent", 1), ("low", 7)]


def test_an_urgent_prefill_runs_without_the_less_urgent_decodes() -> None:
    # a free seat, so nobody is displaced: the two low decodes sit out one step (their
    # state kept), then resume with the tokens of an uninterrupted run
    s = make(max_seqs=4)
    low = [request("low0", 6, priority=5, max_tokens=12), request("low1", 7, priority=5)]
    mid = request("mid", 5, priority=1, max_tokens=12)
    for r in (*low, mid):
        s.add_request(r)
    step(s)
    step(s)  # all three decoding
    urgent = request("urgent", 9, priority=3)  # less urgent than mid, more than the lows
    s.add_request(urgent)
    computed = [r.num_computed_tokens for r in low]
    out = step(s)
    assert out.displaced == [] and out.preempted == []
    assert [(r.request_id, n) for r, n in out.scheduled] == [("mid", 1), ("urgent", 9)]
    assert urgent.num_output_tokens == 1  # its first token in the step after its arrival
    assert [r.num_computed_tokens for r in low] == computed  # paused, nothing lost
    out = step(s)  # the newcomer runs now: everyone decodes again
    assert sorted(r.request_id for r, _ in out.scheduled) == ["low0", "low1", "mid", "urgent"]
    finish(s)
    for r in (*low, mid, urgent):
        assert r.output_token_ids == alone(r), r.request_id


def test_paused_rows_run_when_the_urgent_request_cannot_start() -> None:
    # max_loras 1: the urgent request's adapter does not fit beside the running one, so
    # it is passed over; the less urgent decode must not wait for it (it would never end)
    s = make(max_seqs=4)
    s.max_loras = 1
    low = request("low", 6, priority=5, max_tokens=4)
    low.lora_uid = 1
    s.add_request(low)
    step(s)
    urgent = request("urgent", 5, priority=0, max_tokens=4)
    urgent.lora_uid = 2
    s.add_request(urgent)
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("low", 1)]
    outs = finish(s)
    assert urgent.num_output_tokens == 4 and len(outs) < 10
    assert low.output_token_ids == alone(low)


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="fcfs or priority"):
        make("lottery")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "add", "step", "abort"]), st.integers(0, 9)),
        min_size=10,
        max_size=60,
    ),
    st.integers(6, 30),
    st.integers(2, 32),
)
def test_random_priorities_keep_invariants_and_outputs(
    ops: list[tuple[str, int]], num_blocks: int, budget: int
) -> None:
    s = make(num_blocks=num_blocks, block_size=4, budget=budget, max_seqs=3)
    reqs: dict[str, Request] = {}
    aborted: set[str] = set()
    for op, i in ops:
        rid = f"q{i}"
        if op == "add" and rid not in reqs:
            prompt_len = min(3 + 2 * i, num_blocks * 4 - 8)  # fits the pool alone
            reqs[rid] = request(rid, prompt_len, priority=i % 3, max_tokens=5)
            s.add_request(reqs[rid])
        elif op == "abort" and rid in s.requests:
            s.abort([rid])
            aborted.add(rid)
        elif op == "step":
            waiting = [w.priority for w in s.waiting]
            out = step(s)
            for victim in out.displaced:  # only for a strictly more urgent waiting one
                assert min(waiting) < victim.priority
        assert [r.urgency for r in s.waiting] == sorted(r.urgency for r in s.waiting)
        assert [r.urgency for r in s.running] == sorted(r.urgency for r in s.running)
        assert all(not r.block_ids for r in s.waiting)
    finish(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks
    for rid, r in reqs.items():
        if rid not in aborted:
            assert r.output_token_ids == alone(r), rid


def test_a_request_in_flight_is_never_displaced() -> None:
    # pipeline parallelism: low1's batch is still in flight, so low0 makes the room
    s = make(max_seqs=2)
    for rid in ("low0", "low1"):
        s.add_request(request(rid, 6, priority=4))
    step(s)
    s.add_request(request("urgent", 5, priority=1))
    out = s.schedule(busy={"low1"})
    assert ids(out.displaced) == ["low0"]
    assert ids([r for r, _ in out.scheduled]) == ["urgent"]
    out = s.schedule(busy={"low1", "urgent"})  # nobody left to displace for low0
    assert out.displaced == [] and out.scheduled == []


class Repeat:
    """A proposer that always drafts ``k`` ones (as from a long match)."""

    last_match = MIN_MATCH

    def propose(self, req: Request, k: int) -> list[int]:
        return [1] * k

    def finish(self, req: Request) -> None:
        pass


def test_an_outranked_request_drafts_nothing_while_the_newcomer_waits() -> None:
    s = make(max_seqs=4)
    s.drafter = Drafter(SpeculativeConfig(num_speculative_tokens=2), Repeat())
    low = request("low", 6, priority=3, max_tokens=20)
    s.add_request(low)
    step(s)
    assert [n for _, n in step(s).scheduled] == [3]  # its token and 2 drafts
    s.add_request(request("urgent", 5, priority=0))
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("urgent", 5)]  # low paused
    assert ("low", 3) in [(r.request_id, n) for r, n in step(s).scheduled]  # drafts again
