"""Images in the engine's pure-Python parts (no model): chunks never split a
bidirectional image's span, cut a causal one like text, and count the encoder's work
(scheduler), the prefix cache keys a block over an
image by the image (KV cache manager), the encoder cache's byte bound, LRU order and
pins."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.engine.encoder_cache import EncoderCache
from structllm.engine.kv_cache import KVCacheManager
from structllm.engine.request import Request
from structllm.engine.scheduler import Scheduler
from structllm.protocol import ImageInput, SamplingParams

IMG = 9  # the image token in these prompts


def image(digest: str, offset: int, n: int) -> ImageInput:
    return ImageInput(digest, offset, n, n, (1, 2, 2, 3), bytes(12))


def request(
    rid: str, spans: list[tuple[str, int, int]], length: int, max_tokens: int = 2
) -> Request:
    """A ``length``-token prompt with images ``(hash, offset, n)`` of ``n`` image tokens."""
    tokens = [1 + (i * 7) % 8 for i in range(length)]  # text tokens 1..8
    for _, offset, n in spans:
        tokens[offset : offset + n] = [IMG] * n
    images = [image(h, o, n) for h, o, n in spans]
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens, images)


def test_span_chunk_cuts_before_and_takes_whole() -> None:
    req = request("a", [("x", 4, 8), ("y", 20, 6)], 30)
    assert req.span_chunk(0, 3) == 3  # before the first span
    assert req.span_chunk(0, 6) == 4  # would end inside [4, 12): stops before it
    assert req.span_chunk(0, 12) == 12  # ends with the span
    assert req.span_chunk(4, 2) == 8  # starts at the span: all of it, past the budget
    assert req.span_chunk(7, 1) == 5  # starts inside (a prefix-cache hit): to its end
    assert req.span_chunk(12, 10) == 8  # would end inside [20, 26)
    assert req.span_chunk(0, 30) == 30


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(1, 24), offsets=st.lists(st.integers(0, 40), max_size=3, unique=True))
def test_scheduler_never_splits_a_span(budget: int, offsets: list[int]) -> None:
    spans, end = [], 0
    for k, o in enumerate(sorted(offsets)):
        if o >= end:
            spans.append((f"h{k}", o, 5))
            end = o + 5
    req = request("a", spans, end + 3)
    s = Scheduler(KVCacheManager(64, 4), 4, budget)
    s.add_request(req)
    while req.num_computed_tokens < req.prompt_len:
        out = s.schedule()
        ((r, n),) = out.scheduled
        start = r.num_computed_tokens
        for _, o, length in spans:  # no cut point strictly inside a span
            assert not o < start < o + length and not o < start + n < o + length
        r.num_computed_tokens += n  # (what update does for a chunk that samples nothing)


def test_encoder_work_counts_in_the_budget() -> None:
    # 4 text tokens, an 8-token image, text: budget 16 holds text + image (12), not
    # text + image + its encoder's 8 rows, so the first chunk stops before the image
    s = Scheduler(KVCacheManager(64, 4), 4, 16)
    s.add_request(request("a", [("x", 4, 8)], 30))
    ((_, n),) = s.schedule().scheduled
    assert n == 4
    s2 = Scheduler(KVCacheManager(64, 4), 4, 16)
    s2.encoder_cache = {"x"}  # encoded before: no encoder work
    s2.add_request(request("a", [("x", 4, 8)], 30))
    ((_, n),) = s2.schedule().scheduled
    assert n == 16


def test_an_image_shared_by_two_requests_is_encoded_once_per_step() -> None:
    # each chunk at its image: 8 tokens + 8 encoder rows for the first, 8 for the second
    # (no prefix cache: b would hit a's first block and start inside the span)
    s = Scheduler(KVCacheManager(64, 4, enable_prefix_caching=False), 4, 26)
    s.add_request(request("a", [("x", 0, 8)], 8, max_tokens=1))
    s.add_request(request("b", [("x", 0, 8)], 8, max_tokens=1))
    assert [n for _, n in s.schedule().scheduled] == [8, 8]  # 8 + 8 + 8 <= 26
    # other images: b's chunk starts at its span, which is taken whole though 8 + 8
    # overrun the 10 left; the step is then over budget, so c waits (a step overruns its
    # budget by at most one image)
    s = Scheduler(KVCacheManager(64, 4, enable_prefix_caching=False), 4, 26)
    for rid, h in (("a", "x"), ("b", "y"), ("c", "z")):
        s.add_request(request(rid, [(h, 0, 8)], 8, max_tokens=1))
    assert [n for _, n in s.schedule().scheduled] == [8, 8]


def test_prefix_cache_keys_blocks_by_image() -> None:
    kv = KVCacheManager(32, 4)
    a = request("a", [("x", 5, 6)], 16)
    assert kv.allocate(a, 16)
    same = request("s", [("x", 5, 6)], 16)
    other = request("o", [("y", 5, 6)], 16)
    moved = request("m", [("x", 6, 5)], 16)  # same hash elsewhere: other tokens anyway
    assert len(kv.lookup(same)) == 3  # every full block but the last token's
    assert len(kv.lookup(other)) == 1  # block 0 (positions 0-3) is text only
    assert len(kv.lookup(moved)) == 1
    text = request("t", [], 16)  # a's tokens but text where a's image is
    assert len(kv.lookup(text)) == 1  # block 0, text in both


def test_encoder_cache_bound_lru_and_pins() -> None:
    c: EncoderCache[str] = EncoderCache(100)
    c.put("a", "A", 40)
    c.put("b", "B", 40)
    c.put("c", "C", 40)  # all three pinned by the running step: over the bound
    assert len(c) == 3 and c.num_bytes == 120
    c.unpin_all()  # the step ended: nothing trimmed until the engine says what it holds
    assert len(c) == 3
    c.hold(())  # no request inside an image: the oldest goes
    assert "a" not in c and c.num_bytes == 80
    assert c.get("b") == "B"  # b is now the most recent
    c.put("d", "D", 40)
    assert "c" not in c and "b" in c and "d" in c
    assert (c.num_hits, c.num_misses) == (1, 0)
    assert c.get("zz") is None and c.num_misses == 1
    c.unpin_all()
    c.pin("b")
    c.put("e", "E", 90)  # b pinned: d goes, b stays until unpinned
    assert "b" in c and "d" not in c
    c.unpin_all()
    c.hold(())
    assert list(c.entries) == ["e"]


def test_held_entries_outlive_the_step_until_released() -> None:
    c: EncoderCache[str] = EncoderCache(100)
    c.put("a", "A", 60)
    c.unpin_all()
    c.hold(["a"])  # a request is part-way through a's span
    c.put("b", "B", 60)
    c.unpin_all()
    c.hold(["a"])  # b goes though more recent: a is held
    assert list(c.entries) == ["a"]
    c.put("b", "B", 60)
    c.unpin_all()
    c.hold([])  # a's span done: a, the oldest, goes
    assert list(c.entries) == ["b"]


def test_open_images_are_those_the_computed_tokens_end_inside() -> None:
    req = request("a", [("x", 4, 8), ("y", 20, 6)], 30)
    for done, want in [(0, []), (4, []), (5, ["x"]), (11, ["x"]), (12, []), (23, ["y"])]:
        req.num_computed_tokens = done
        assert req.open_images() == want, done


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(1, 24), offsets=st.lists(st.integers(0, 40), max_size=3, unique=True))
def test_split_spans_cut_like_text_within_the_budget(budget: int, offsets: list[int]) -> None:
    # causal image attention: chunks of the budget (less an image's encoder rows in the
    # chunk that runs its encoder: text stops before it, or the chunk starting at it
    # shrinks to what is left, one token at least); each image's encoder counted once
    spans, end = [], 0
    for k, o in enumerate(sorted(offsets)):
        if o >= end:
            spans.append((f"h{k}", o, 5))
            end = o + 5
    req = request("a", spans, end + 3)
    s = Scheduler(KVCacheManager(64, 4), 4, budget)
    s.split_spans = True
    cached: set[str] = set()
    s.encoder_cache = cached
    s.add_request(req)
    steps = 0
    while req.num_computed_tokens < req.prompt_len:
        ((r, n),) = s.schedule().scheduled
        start, steps = r.num_computed_tokens, steps + 1
        new = [h for h, o, ln in spans if o < start + n and start < o + ln and h not in cached]
        assert n + 5 * len(new) <= max(budget, 6)  # over only where one token + 5 rows
        assert (
            n == min(budget, req.prompt_len - start) or new or start + n in {o for _, o, _ in spans}
        )
        cached.update(new)  # the runner encodes and the engine holds them
        r.num_computed_tokens += n
    assert steps <= -(-req.prompt_len // budget) + 2 * len(spans)


def test_split_spans_cut_a_span_and_gemma_spans_stay_whole() -> None:
    # 4 text tokens, an 8-token image at 4, text to 30; budget 6, image cached
    for split, first, inside in [(True, 6, 6), (False, 4, 7)]:
        s = Scheduler(KVCacheManager(64, 4), 4, 6)
        s.split_spans = split
        s.encoder_cache = {"x"}
        s.add_request(request("a", [("x", 4, 8)], 30))
        ((r, n),) = s.schedule().scheduled
        assert n == first  # split: into the image; whole: stops before it
        r.num_computed_tokens = 5  # inside the span (a split chunk, or a prefix-cache hit)
        ((_, n),) = s.schedule().scheduled
        assert n == inside  # split: the budget, to 11; whole: the rest of the span, to 12
    s = Scheduler(KVCacheManager(64, 4), 4, 10)  # not cached: text stops at the image
    s.split_spans = True
    s.add_request(request("a", [("x", 4, 8)], 30))
    ((r, n),) = s.schedule().scheduled
    assert n == 4
    r.num_computed_tokens = 4
    ((r, n),) = s.schedule().scheduled
    assert n == 2  # 2 tokens + 8 encoder rows: the budget


def test_a_prefix_hit_inside_a_span_takes_the_rest_of_it() -> None:
    s = Scheduler(KVCacheManager(64, 4), 4, 64)
    s.add_request(request("a", [("x", 0, 8)], 8, max_tokens=1))
    s.add_request(request("b", [("x", 0, 8)], 8, max_tokens=1))
    ((_, n), (b, m)) = s.schedule().scheduled
    assert (n, b.num_computed_tokens, m) == (8, 4, 4)  # b hit a's block 0: positions 4-7
