"""Block bookkeeping for the paged KV cache, with prefix caching.

Pure Python and deterministic: it decides which block holds which tokens; the model
runner owns the tensors.

Prefix caching. A full block is identified by its *chain key* ``(parent_chain_id,
tokens_of_the_block, images_of_the_block)``, where ``parent_chain_id`` identifies the
previous block of the same sequence (0 for the first block). Every distinct key gets a
fresh, never reused integer *chain id*, so a key pins down the whole token prefix up to
and including its block: a cached block is reused only when every token before and in
it matches. Keys are compared exactly (a dict), so a hash collision cannot alias two
prefixes. ``images_of_the_block`` is ``Request.block_images``: ``(image hash, the
block's first position minus the image's offset)`` for each image whose span overlaps
the block (empty for text), so the same placeholder tokens over two different images
never share a block, and over the same image they do. A request with a LoRA adapter
starts its chain from ``-lora_uid`` (``Request.lora_uid``, fresh on each load of an
adapter) instead of 0, so its blocks (whose K/V the adapter changed) are hit only by
requests with the same load of the same adapter.

Free blocks sit in ``free`` in eviction order (front first). A block whose last
reference goes keeps its key and goes to the back, so it can still be hit until the
pool needs it (least recently used first); a block with no key goes to the front.
Requests release their blocks last-to-first, so a sequence's tail is evicted before
its head.

Sliding windows (``window``: set only when every layer has one, e.g. Mistral; a model
with any global layer, Gemma 2/3, reads every position, so nothing can go): a block
whose positions are all behind the window of the next query to run is never read
again, and ``release_behind_window`` gives it back (vLLM's sliding-window manager). It
stays in the prefix cache like any freed block, so another request with the same
prefix can still hit it until it is evicted. Its entry in ``block_ids`` then names the
first block the request still holds: block tables keep their positions, and an
attention backend that loads a whole tile and masks it still reads finite K/V.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from structllm.engine.request import Request

ChainKey = tuple[int, tuple[int, ...], tuple[tuple[str, int], ...]]


def chain_key(req: Request, parent: int, i: int, bs: int) -> ChainKey:
    """The chain key of ``req``'s full block ``i`` after the block ``parent`` names."""
    first, end = i * bs, (i + 1) * bs
    images = req.block_images(first, end) if req.images else ()
    return (parent, tuple(req.token_ids[first:end]), images)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window  # keys a query of any layer sees (0: some layer sees all)
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_key: list[ChainKey | None] = [None] * num_blocks
        self.block_chain_id = [0] * num_blocks
        self.cached: dict[ChainKey, int] = {}  # key -> block holding those tokens
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._next_chain_id = 1
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0
        # told the chain id of each block leaving the prefix cache (hybrid models drop
        # the recurrent state saved at its end: engine.state_cache)
        self.on_evict: Callable[[int], None] | None = None

    # -- queries ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached but free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def lookup(self, req: Request) -> list[int]:
        """The longest chain of cached blocks matching ``req``'s tokens from the start.

        At least one token is left uncached so the step that admits ``req`` computes
        logits. Takes no references; pass the result to ``allocate``.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = -req.lora_uid  # (0: no adapter; see chain_key)
        for i in range((req.num_tokens - 1) // bs):
            block = self.cached.get(chain_key(req, parent, i, bs))
            if block is None:
                break
            hits.append(block)
            parent = self.block_chain_id[block]
        return hits

    def blocks_needed(self, req: Request, num_new_tokens: int, hits: Sequence[int] = ()) -> int:
        """New blocks ``allocate(req, num_new_tokens, hits)`` would take from the pool."""
        computed = req.num_computed_tokens + len(hits) * self.block_size
        total = -(-(computed + num_new_tokens) // self.block_size)
        return max(0, total - len(req.block_ids) - len(hits))

    # -- updates ---------------------------------------------------------------------

    def allocate(self, req: Request, num_new_tokens: int, hits: Sequence[int] = ()) -> bool:
        """Give ``req`` blocks for ``num_new_tokens`` more tokens, first taking the cached
        ``hits`` (from ``lookup``, only when ``req`` holds no blocks yet). Returns False,
        changing nothing, if the pool cannot supply them. Registers every block that
        this step fills, so requests admitted later in the same step can hit it: the
        runner stores a layer's K/V before any token of that layer attends. First gives
        back the blocks behind the window (even if it then returns False: no query reads
        them again)."""
        if hits and req.block_ids:
            raise ValueError("prefix hits can only be taken by a request without blocks")
        self.release_behind_window(req)
        need = self.blocks_needed(req, num_new_tokens, hits)
        reclaimed = sum(1 for b in hits if self.ref_cnt[b] == 0)  # hits now in the free list
        if need > len(self.free) - reclaimed:
            return False
        for b in hits:
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1
            req.block_ids.append(b)
            req.chain_ids.append(self.block_chain_id[b])
        if hits:
            req.num_computed_tokens = len(hits) * self.block_size
        for _ in range(need):
            b, _ = self.free.popitem(last=False)
            self._evict(b)
            self.ref_cnt[b] = 1
            req.block_ids.append(b)
        self._register_full_blocks(req, req.num_computed_tokens + num_new_tokens)
        return True

    def free_blocks(self, req: Request) -> None:
        """Release all of ``req``'s blocks (finish, abort or preemption)."""
        for b in reversed(req.block_ids[req.num_released_blocks :]):
            self._release(b)
        req.block_ids = []
        req.chain_ids = []
        req.num_released_blocks = 0

    def release_behind_window(self, req: Request) -> None:
        """Give back ``req``'s blocks whose positions all lie behind the window of its
        next query (position ``num_computed_tokens``, which sees keys from
        ``num_computed_tokens - window + 1`` on); nothing without ``window``."""
        if not self.window or not req.block_ids:
            return
        first_seen = max(0, req.num_computed_tokens - self.window + 1)
        dead = min(first_seen // self.block_size, len(req.block_ids) - 1)
        held = req.block_ids[dead]  # what the released entries name from now on
        for i in range(req.num_released_blocks, dead):
            self._release(req.block_ids[i])
            req.block_ids[i] = held
        req.num_released_blocks = max(req.num_released_blocks, dead)

    def trim(self, req: Request) -> None:
        """Release ``req``'s blocks past those its tokens need (blocks taken for drafts
        that were rejected). They hold no committed full block, so none is cached."""
        keep = -(-req.num_tokens // self.block_size)
        while len(req.block_ids) > keep:
            self._release(req.block_ids.pop())
        del req.chain_ids[keep:]

    def forget_uncomputed(self, req: Request) -> None:
        """Unregister the blocks ``allocate`` registered for tokens of ``req`` that were
        never computed (a step cut short: their K/V holds only some layers), so
        that no later request hits them. Blocks ``req`` took from the cache, or that were
        computed in an earlier step, stay cached."""
        done = req.num_computed_tokens // self.block_size  # blocks whose K/V is whole
        for i in range(done, len(req.chain_ids)):
            b = req.block_ids[i]
            key = self.block_key[b]
            # b in the cache under req's chain id: registered for req's own tokens (a
            # block of the same prefix registered by another request is left to it)
            if (
                key is not None
                and self.cached.get(key) == b
                and self.block_chain_id[b] == req.chain_ids[i]
            ):
                self._evict(b)
        del req.chain_ids[done:]

    def record_admission(self, req: Request, num_hit_tokens: int) -> None:
        """Count one admission's prompt lookup in the prefix-cache stats."""
        self.num_queried_tokens += req.prompt_len
        self.num_hit_tokens += min(num_hit_tokens, req.prompt_len)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds."""
        for b in list(self.free):
            self._evict(b)

    # -- internals -------------------------------------------------------------------

    def _release(self, b: int) -> None:
        """Drop one reference to block ``b``; a block no one holds becomes free (at the
        back of the eviction order if cached, else at the front)."""
        self.ref_cnt[b] -= 1
        if self.ref_cnt[b] == 0:
            self.free[b] = None
            if self.block_key[b] is None:
                self.free.move_to_end(b, last=False)

    def _evict(self, block: int) -> None:
        key = self.block_key[block]
        if key is not None:
            if self.on_evict is not None:
                self.on_evict(self.block_chain_id[block])
            del self.cached[key]
            self.block_key[block] = None
            self.block_chain_id[block] = 0

    def _register_full_blocks(self, req: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(req.chain_ids), min(num_tokens, req.num_tokens) // bs):
            parent = req.chain_ids[i - 1] if i else -req.lora_uid
            key = chain_key(req, parent, i, bs)
            existing = self.cached.get(key)
            if existing is not None:  # same prefix computed twice: keep the first copy
                req.chain_ids.append(self.block_chain_id[existing])
                continue
            block = req.block_ids[i]
            chain_id = self._next_chain_id
            self._next_chain_id += 1
            self.cached[key] = block
            self.block_key[block] = key
            self.block_chain_id[block] = chain_id
            req.chain_ids.append(chain_id)

    def check_invariants(self, live: list[Request]) -> None:
        """Assert the bookkeeping is consistent with the live (block-holding) requests."""
        counts = [0] * self.num_blocks
        for r in live:
            for b in r.block_ids[r.num_released_blocks :]:
                counts[b] += 1
        assert counts == self.ref_cnt, "ref counts differ from the blocks requests hold"
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] >= 0, f"block {b} has a negative ref count"
            assert (b in self.free) == (self.ref_cnt[b] == 0), (
                f"block {b} is both free and referenced"
            )
        for key, b in self.cached.items():
            assert self.block_key[b] == key, f"cached key of block {b} out of sync"
        assert sum(k is not None for k in self.block_key) == len(self.cached)
