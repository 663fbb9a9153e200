"""Recurrent-state slots for hybrid models, beside the paged KV cache.

A hybrid model's recurrent layers (LFM2's short convolutions, Gated DeltaNet, Mamba)
keep a fixed-size state per request, whatever its length: each layer holds one row per
slot (``[S, ...]`` tensors, owned by the runner). This module decides which request
holds which slot: pure Python and deterministic, like ``kv_cache``.

A request takes a slot when the scheduler admits it (with its first KV blocks) and
gives it back when it finishes, is aborted or is preempted; a preempted request is
recomputed from its first token, so its state is rebuilt from zero in whatever slot it
gets next. The slots come out of the same memory budget as the KV blocks
(``EngineCore._size_kv_cache``), so their count bounds the requests that run at once.
"""

from __future__ import annotations

import heapq

from structllm.engine.request import Request


class StateCacheManager:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the state cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # a heap, lowest first, so an idle engine always hands out the same slots
        self.free: list[int] = list(range(num_slots))

    @property
    def num_free_slots(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of slots held by requests."""
        return 1.0 - len(self.free) / self.num_slots

    def allocate(self, req: Request) -> bool:
        """Give ``req`` a slot (if it holds none yet); False when none is free."""
        if req.state_slot >= 0:
            return True
        if not self.free:
            return False
        req.state_slot = heapq.heappop(self.free)
        return True

    def free_slot(self, req: Request) -> None:
        """Take ``req``'s slot back (finish, abort, preemption); nothing if it has none."""
        if req.state_slot >= 0:
            heapq.heappush(self.free, req.state_slot)
            req.state_slot = -1

    def check_invariants(self, live: list[Request]) -> None:
        """Assert that the live requests and the free list share the slots exactly."""
        held = [r.state_slot for r in live if r.state_slot >= 0]
        assert len(held) == len(set(held)), "two requests hold the same state slot"
        assert not set(held) & set(self.free), "a held state slot is also free"
        assert len(held) + len(self.free) == self.num_slots, "a state slot went missing"
