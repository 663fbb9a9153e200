"""KV cache manager: allocation, reference counts, prefix caching, eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.engine.kv_cache import KVCacheManager
from structllm.engine.request import Request
from structllm.protocol import SamplingParams

BS = 4


def req(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), 8)


def admit(kv: KVCacheManager, r: Request, n: int | None = None) -> bool:
    hits = kv.lookup(r)
    ok = kv.allocate(r, (n if n is not None else r.num_tokens) - len(hits) * BS, hits)
    return ok


def test_allocate_takes_ceil_blocks_and_free_returns_them() -> None:
    kv = KVCacheManager(8, BS)
    r = req(list(range(10)))
    assert admit(kv, r)
    assert len(r.block_ids) == 3
    assert kv.num_free_blocks == 5
    kv.free_blocks(r)
    assert kv.num_free_blocks == 8
    kv.check_invariants([])


def test_allocate_refuses_without_side_effects_when_pool_is_short() -> None:
    kv = KVCacheManager(2, BS)
    r = req(list(range(12)))
    assert not admit(kv, r)
    assert r.block_ids == [] and kv.num_free_blocks == 2
    kv.check_invariants([])


def test_prefix_hit_requires_whole_chain() -> None:
    kv = KVCacheManager(16, BS)
    a = req([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    admit(kv, a)
    kv.free_blocks(a)
    same = req([1, 2, 3, 4, 5, 6, 7, 8, 0], "b")
    assert len(kv.lookup(same)) == 2
    # second block equal, first block different: no hit at all
    other_first = req([0, 2, 3, 4, 5, 6, 7, 8, 9], "c")
    assert kv.lookup(other_first) == []


def test_lookup_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(16, BS)
    a = req(list(range(8)), "a")
    admit(kv, a)
    kv.free_blocks(a)
    again = req(list(range(8)), "b")
    assert len(kv.lookup(again)) == 1  # 8 tokens = 2 full blocks, but the last is recomputed


def test_cached_free_blocks_are_evicted_lru_and_only_when_needed() -> None:
    kv = KVCacheManager(4, BS)
    a = req(list(range(8)), "a")  # 2 blocks
    admit(kv, a)
    kv.free_blocks(a)
    b = req(list(range(100, 109)), "b")  # 3 blocks: needs to evict one cached block
    assert admit(kv, b)
    # a's tail block was released first, so it is evicted first; its head survives
    assert len(kv.lookup(req(list(range(8)) + [0], "c"))) == 1
    kv.check_invariants([b])


def test_shared_prefix_blocks_are_referenced_twice() -> None:
    kv = KVCacheManager(16, BS)
    a = req(list(range(9)), "a")
    admit(kv, a)
    b = req(list(range(8)) + [50, 51], "b")
    assert admit(kv, b)
    assert b.num_computed_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert kv.ref_cnt[a.block_ids[0]] == 2
    kv.check_invariants([a, b])
    kv.free_blocks(a)
    kv.free_blocks(b)
    kv.check_invariants([])
    assert kv.num_free_blocks == 16


def test_duplicate_content_keeps_one_cached_copy() -> None:
    kv = KVCacheManager(16, BS)
    a, b = req(list(range(9)), "a"), req(list(range(9)), "b")
    admit(kv, a)
    kv.allocate(b, 9)  # computed concurrently, no lookup
    assert len(kv.cached) == 2
    kv.check_invariants([a, b])


def test_disabled_prefix_caching_never_hits() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    a = req(list(range(9)), "a")
    admit(kv, a)
    kv.free_blocks(a)
    assert kv.lookup(req(list(range(9)), "b")) == []


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 7), st.integers(1, 20)),
        max_size=60,
    )
)
def test_random_operations_keep_invariants(ops: list[tuple[str, int, int]]) -> None:
    kv = KVCacheManager(12, BS)
    live: dict[int, Request] = {}
    for op, slot, n in ops:
        r = live.get(slot)
        if op == "add" and r is None:
            new = req([(slot * 7 + i) % 5 for i in range(n)], str(slot))  # low-entropy: many hits
            if admit(kv, new):
                new.num_computed_tokens = new.num_tokens
                live[slot] = new
        elif op == "grow" and r is not None:
            r.token_ids += [n % 5] * n
            if kv.allocate(r, r.num_tokens - r.num_computed_tokens):
                r.num_computed_tokens = r.num_tokens
            else:
                del r.token_ids[r.num_computed_tokens :]
        elif op == "free" and r is not None:
            kv.free_blocks(r)
            del live[slot]
        kv.check_invariants(list(live.values()))
    for r in live.values():
        kv.free_blocks(r)
    kv.check_invariants([])
    assert kv.num_free_blocks == kv.num_blocks


def decode(kv: KVCacheManager, r: Request, steps: int) -> None:
    """``steps`` decode steps: the newest token computed, one more allocated."""
    for _ in range(steps):
        r.num_computed_tokens = r.num_tokens
        r.token_ids.append(100 + r.num_tokens)
        assert kv.allocate(r, 1)


def test_blocks_behind_every_window_are_given_back_and_stay_cached() -> None:
    kv = KVCacheManager(8, BS, window=6)
    r = req(list(range(10)))
    assert admit(kv, r) and kv.num_free_blocks == 5
    first = list(r.block_ids)
    decode(kv, r, 1)  # the query at 10 sees 5..10: block 0 (0..3) is behind it
    assert r.num_released_blocks == 1 and kv.num_free_blocks == 6
    assert r.block_ids[0] == r.block_ids[1] == first[1]  # positions kept, a held block named
    kv.check_invariants([r])
    # a released block keeps its key: the same prefix still hits it (until evicted)
    assert kv.lookup(req(list(range(10)), "b")) == first[:2]
    decode(kv, r, 30)  # 41 tokens: without the window 11 blocks, more than the pool
    live = r.block_ids[r.num_released_blocks :]
    assert len(r.block_ids) == 11 and len(live) <= -(-6 // BS) + 1
    assert r.num_tokens - 6 < (r.num_released_blocks + 1) * BS  # all it reads is held
    kv.check_invariants([r])
    kv.free_blocks(r)
    assert kv.num_free_blocks == 8 and r.num_released_blocks == 0
    kv.check_invariants([])


def test_without_a_window_every_block_is_kept() -> None:
    kv = KVCacheManager(16, BS)
    r = req(list(range(10)))
    assert admit(kv, r)
    decode(kv, r, 20)
    assert r.num_released_blocks == 0 and kv.num_free_blocks == 16 - 8
    kv.check_invariants([r])
