"""The state cache of hybrid models (``engine.state_cache``) with the scheduler and the
prefix cache, no model: where chunks save recurrent states, which hits can resume, and
that a resumed state is exactly the one its prefix would have left.

A fake recurrent model keeps, per state row, the tuple of tokens it has consumed (the
"state"), and samples each next token from it. So a request that resumed a wrong state
samples other tokens, and ``run`` asserts at every chunk that the slot holds exactly the
request's computed tokens.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.engine.kv_cache import KVCacheManager
from structllm.engine.request import Request
from structllm.engine.scheduler import Scheduler
from structllm.engine.state_cache import StateCacheManager
from structllm.protocol import SamplingParams

BS = 4
VOCAB = 50
State = tuple[int, ...]


def token_from(state: State) -> int:
    return 1 + (sum(t * (i + 1) for i, t in enumerate(state)) % (VOCAB - 1))


def make(
    num_blocks: int = 64,
    budget: int = 64,
    max_seqs: int = 4,
    num_saved: int = 8,
    caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, caching)
    states = StateCacheManager(max_seqs, num_saved if caching else 0)
    kv.on_evict = states.drop
    return Scheduler(kv, max_seqs, budget, [], states)


def request(rid: str, prompt: list[int], max_tokens: int = 5) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens)


def step(s: Scheduler, rows: dict[int, State]) -> None:
    """One step of the fake model: loads before any chunk runs, saves at their
    boundaries, then the sampled tokens."""
    out = s.schedule()
    for req, _ in out.scheduled:
        if req.state_load >= 0:
            rows[req.state_slot] = rows[req.state_load]
    for req, n in out.scheduled:
        start = req.num_computed_tokens
        state = () if start == 0 else rows[req.state_slot]
        assert state == tuple(req.token_ids[:start]), f"{req.request_id} resumed a wrong state"
        if req.state_save is not None:
            at, row = req.state_save
            assert start < at <= start + n and at % BS == 0
            rows[row] = state + tuple(req.token_ids[start:at])
        rows[req.state_slot] = state + tuple(req.token_ids[start : start + n])
    sampled = {r.request_id: token_from(rows[r.state_slot]) for r in out.sampling_requests()}
    s.update(out, sampled)
    check(s)


def check(s: Scheduler) -> None:
    assert s.states is not None
    live = list(s.requests.values())
    s.kv.check_invariants(s.running)
    s.states.check_invariants(live, [s.kv.block_chain_id[b] for b in s.kv.cached.values()])
    assert not s.states.pending, "a planned save outlived its step"


def run(s: Scheduler, reqs: list[Request], rows: dict[int, State]) -> dict[str, list[int]]:
    for r in reqs:
        s.add_request(r)
    for _ in range(10_000):
        if not s.has_work:
            break
        step(s, rows)
    assert not s.has_work
    return {r.request_id: r.output_token_ids for r in reqs}


def test_a_repeated_prompt_resumes_at_its_last_block_before_the_last_token() -> None:
    s = make()
    rows: dict[int, State] = {}
    prompt = list(range(10, 23))  # 13 tokens: blocks end at 4, 8, 12
    first = run(s, [request("a", prompt)], rows)
    again = request("b", prompt)
    assert run(s, [again], rows)["b"] == first["a"]
    assert again.num_cached_tokens == 12
    exact = list(range(10, 22))  # 12 tokens: one must be computed, so 8 resume
    s2, rows2 = make(), {}
    run(s2, [request("a", exact)], rows2)
    again = request("b", exact)
    run(s2, [again], rows2)
    assert again.num_cached_tokens == 8


def test_chunks_save_at_their_last_boundary_and_a_shared_prefix_hits_no_more() -> None:
    s = make(budget=6)  # chunks of 6: ends 6, 12, 18 save at 4, 12, 16; the last at 20
    rows: dict[int, State] = {}
    prompt = list(range(1, 23))  # 22 tokens
    run(s, [request("a", prompt)], rows)
    assert s.states is not None and len(s.states.saved) == 4
    # sharing the first 3 blocks (12 tokens), then other tokens: 12 resume, not more
    b = request("b", prompt[:12] + [40] * 10)
    # sharing 2 blocks and 2 tokens: the state at 8 was not saved, at 4 was
    c = request("c", prompt[:10] + [41] * 10)
    want = run(make(caching=False), [request("b", b.token_ids), request("c", c.token_ids)], {})
    assert run(s, [b, c], rows) == want
    assert (b.num_cached_tokens, c.num_cached_tokens) == (12, 4)
    assert s.kv.num_hit_tokens == 16


def test_a_state_saved_in_a_step_is_hit_only_after_it() -> None:
    s = make()
    rows: dict[int, State] = {}
    prompt = list(range(5, 19))
    a, b = request("a", prompt), request("b", prompt)
    s.add_request(a)
    s.add_request(b)
    step(s, rows)  # both admitted in one step: b finds a's blocks, not a ready state
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)
    run(s, [], rows)
    c = request("c", prompt)
    run(s, [c], rows)
    assert c.num_cached_tokens == 12


def test_a_step_cut_short_writes_no_state() -> None:
    s = make(budget=8)
    rows: dict[int, State] = {}
    prompt = list(range(3, 30))
    a = request("a", prompt)
    s.add_request(a)
    step(s, rows)  # 0..8, saved at 8
    out = s.schedule()  # 8..16, a save planned at 16: the step is cut short
    assert s.states is not None and a.state_save is not None
    for req, _ in out.scheduled:
        s.kv.forget_uncomputed(req)
    s.states.forget_uncomputed([req for req, _ in out.scheduled])
    assert a.state_save is None and not s.states.pending
    s.abort(["a"])
    check(s)
    b = request("b", prompt)
    run(s, [b], rows)
    assert b.num_cached_tokens == 8


def test_the_least_recently_used_state_goes_and_takes_no_block_with_it() -> None:
    s = make(num_saved=2)
    rows: dict[int, State] = {}
    prompts = [[p] * 9 for p in (1, 2, 3)]  # each saves one state, at 8
    for i, p in enumerate(prompts):
        run(s, [request(str(i), p)], rows)
    assert s.states is not None and len(s.states.saved) == 2
    hits = []
    for i in (0, 2):  # the first's state went (its blocks did not); the last's is there
        r = request(f"again{i}", prompts[i])
        run(s, [r], rows)
        hits.append(r.num_cached_tokens)
    assert hits == [0, 8]


def test_a_block_leaving_the_prefix_cache_takes_its_state() -> None:
    s = make(num_blocks=6)
    rows: dict[int, State] = {}
    run(s, [request("a", [1] * 9)], rows)
    assert s.states is not None and len(s.states.saved) == 1
    run(s, [request("b", [2] * 17)], rows)  # 6 blocks: every block of a's is evicted
    assert len(s.states.saved) == 1  # b's own, a's dropped with its block
    s.kv.reset_prefix_cache()
    assert not s.states.saved and s.states.num_saved_used == 0


def test_a_single_token_chunk_saves_nothing() -> None:
    s = make(budget=1)
    rows: dict[int, State] = {}
    run(s, [request("a", list(range(1, 10)))], rows)
    assert s.states is not None and not s.states.saved


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 14), st.integers(1, 6)),
        min_size=1,
        max_size=10,
    ),
    st.integers(2, 24),
    st.integers(8, 40),
    st.integers(0, 3),
)
def test_any_batching_eviction_or_preemption_gives_uncached_outputs(
    specs: list[tuple[int, int, int]], budget: int, num_blocks: int, num_saved: int
) -> None:
    # prompts sharing one of four heads, then a tail of their own: states saved,
    # evicted (few rows, few blocks), resumed, requests preempted
    heads = [[(h * 7 + i) % VOCAB or 1 for i in range(10)] for h in range(4)]
    prompts = [
        heads[h] + [(j * 3 + i) % VOCAB or 2 for i in range(t)] for j, (h, t, _) in enumerate(specs)
    ]
    reqs = [
        request(str(i), p, m) for i, (p, (_, _, m)) in enumerate(zip(prompts, specs, strict=True))
    ]
    alone = make(num_blocks=64, budget=64, caching=False)
    want = {
        r.request_id: run(alone, [request(r.request_id, r.token_ids, r.max_tokens)], {})[
            r.request_id
        ]
        for r in reqs
    }
    s = make(num_blocks=num_blocks, budget=budget, num_saved=num_saved)
    half = len(reqs) // 2
    rows: dict[int, State] = {}
    got = run(s, reqs[:half], rows)
    got.update(run(s, reqs[half:], rows))  # a second wave, resuming the first's states
    assert got == want
    assert s.states is not None and s.states.num_free_slots == s.states.num_slots
    assert s.kv.num_hit_tokens == sum(r.num_cached_tokens for r in reqs)
