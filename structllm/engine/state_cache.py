"""Recurrent-state rows for hybrid models, beside the paged KV cache: one slot per
running request, and saved states that let a cached prefix be resumed.

A hybrid model's recurrent layers (LFM2's short convolutions, Gated DeltaNet, Mamba)
keep a fixed-size state per request, whatever its length: each layer holds one row per
slot (``[R, ...]`` tensors, owned by the runner). This module decides which row holds
what: pure Python and deterministic, like ``kv_cache``.

Slots (rows ``0 .. num_slots - 1``). A request takes a slot when the scheduler admits
it (with its first KV blocks) and gives it back when it finishes, is aborted or is
preempted; a preempted request is recomputed from its first token (or from a saved
state, below) in whatever slot it gets next. The rows come out of the same memory
budget as the KV blocks (``EngineCore._size_state_cache``), so the slots bound the
requests that run at once.

Saved states (rows ``num_slots ..``, ``num_saved`` of them; prefix caching). The state
after a prefix of N tokens can only be resumed if it was kept at exactly N, so a
prefill chunk of more than one token saves the state at one full-block boundary ``L``
it passes (``plan_save``): its end when that is a boundary, else the last boundary
before it; in the chunk that reaches the request's last known token, the boundary
that a request with the same tokens can hit (the prefix cache leaves it one token to
compute). The recurrent layers copy the slot's state to the saved row once they have
run the chunk's rows up to ``L`` (``model.recurrent``: the chunk runs as two segments
there, so no step is added). The saved state is keyed by the *chain id* of the block
ending at ``L`` (``kv_cache``: it names the whole token prefix), and lives as long as
that block stays in the prefix cache (``drop``, called when the block is evicted) or
until its row is needed for a newer save (least recently used first).

A prefix-cache hit of ``k`` blocks is cut to the longest ``j <= k`` whose block ``j``
has a saved state (``longest_saved``); the runner copies it into the request's slot
before the step (``Request.state_load``), and prefill starts at ``j`` blocks. A state
saved in a step is not *ready* (hit) until that step has run (``commit``); a step cut
short leaves its planned saves unwritten, and ``forget_uncomputed`` takes them back.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from structllm.engine.request import Request


class StateCacheManager:
    def __init__(self, num_slots: int, num_saved: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"the state cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.num_saved = num_saved
        # a heap, lowest first, so an idle engine always hands out the same slots
        self.free: list[int] = list(range(num_slots))
        # saved states: chain id -> row, ready ones in eviction order (front first)
        self.saved: OrderedDict[int, int] = OrderedDict()
        self.pending: dict[int, int] = {}  # planned this step, written when it runs
        self.dead: list[int] = []  # rows of pending saves whose block went: freed later
        self.free_saved: list[int] = list(range(num_slots, num_slots + num_saved))

    @property
    def num_rows(self) -> int:
        """Rows of every recurrent layer's state tensors: the slots, then saved states."""
        return self.num_slots + self.num_saved

    @property
    def num_free_slots(self) -> int:
        return len(self.free)

    @property
    def num_saved_used(self) -> int:
        """Saved-state rows holding (or about to hold) a state."""
        return self.num_saved - len(self.free_saved)

    @property
    def usage(self) -> float:
        """Fraction of slots held by requests."""
        return 1.0 - len(self.free) / self.num_slots

    # -- slots -----------------------------------------------------------------------

    def allocate(self, req: Request) -> bool:
        """Give ``req`` a slot (if it holds none yet); False when none is free."""
        if req.state_slot >= 0:
            return True
        if not self.free:
            return False
        req.state_slot = heapq.heappop(self.free)
        return True

    def free_slot(self, req: Request) -> None:
        """Take ``req``'s slot back (finish, abort, preemption); nothing if it has none.
        Drops the step's load and save plans too (a preempted request runs no more in
        the step)."""
        req.state_load = -1
        req.state_save = None
        if req.state_slot >= 0:
            heapq.heappush(self.free, req.state_slot)
            req.state_slot = -1

    # -- saved states ----------------------------------------------------------------

    def longest_saved(self, chain_ids: Sequence[int]) -> int:
        """The most leading blocks of ``chain_ids`` (a prefix-cache hit's) whose last
        block has a ready saved state; 0 if none has."""
        for k in range(len(chain_ids), 0, -1):
            if chain_ids[k - 1] in self.saved:
                return k
        return 0

    def load(self, req: Request, chain_id: int) -> None:
        """``req`` resumes from the state saved for ``chain_id`` (its hit's last block):
        the runner copies it into ``req``'s slot before the step."""
        self.saved.move_to_end(chain_id)  # recently used
        req.state_load = self.saved[chain_id]

    def plan_save(self, req: Request, num_new_tokens: int, block_size: int) -> None:
        """Plan where ``req``'s chunk of ``num_new_tokens`` (scheduled, its blocks
        allocated and registered) saves its state, if anywhere (see the module's
        docstring): not for a single token (a decode row), nor where the boundary's
        block is not in the prefix cache or already has a state, nor when every row
        holds a state planned in this step."""
        if not self.num_saved or num_new_tokens < 2:
            return
        start = req.num_computed_tokens
        end = start + num_new_tokens
        last = end - 1 if end >= req.num_tokens else end  # a repeat leaves one token
        at = last // block_size * block_size
        if at <= start or at // block_size > len(req.chain_ids):
            return
        chain = req.chain_ids[at // block_size - 1]
        if chain in self.saved or chain in self.pending:
            return
        if self.free_saved:
            row = self.free_saved.pop()
        elif self.saved:
            row = self.saved.popitem(last=False)[1]  # the least recently used
        else:
            return
        self.pending[chain] = row
        req.state_save = (at, row)

    def commit(self, reqs: Iterable[Request]) -> None:
        """The step has run: its saves are written and can be hit; ``reqs`` (the step's)
        are done with their load and save plans."""
        for chain, row in self.pending.items():
            self.saved[chain] = row
        self.pending.clear()
        self._end_step(reqs)

    def forget_uncomputed(self, reqs: Iterable[Request]) -> None:
        """The step was cut short: no planned save was written (or only for some
        layers); their rows go back."""
        self.free_saved += self.pending.values()
        self.pending.clear()
        self._end_step(reqs)

    def drop(self, chain_id: int) -> None:
        """The prefix cache evicted the block ``chain_id`` names: its state can never be
        hit again (a recomputed prefix gets a new chain id). A save still planned
        keeps its row until the step has run (the step writes it)."""
        row = self.saved.pop(chain_id, None)
        if row is not None:
            self.free_saved.append(row)
        row = self.pending.pop(chain_id, None)
        if row is not None:
            self.dead.append(row)

    def _end_step(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            req.state_load = -1
            req.state_save = None
        self.free_saved += self.dead
        self.dead.clear()

    def check_invariants(
        self, live: list[Request], cached_chains: Collection[int] | None = None
    ) -> None:
        """Assert that the live requests and the free list share the slots exactly, and
        that every saved-state row is free or holds one state (of a cached block)."""
        held = [r.state_slot for r in live if r.state_slot >= 0]
        assert len(held) == len(set(held)), "two requests hold the same state slot"
        assert not set(held) & set(self.free), "a held state slot is also free"
        assert len(held) + len(self.free) == self.num_slots, "a state slot went missing"
        rows = [*self.saved.values(), *self.pending.values(), *self.dead, *self.free_saved]
        assert sorted(rows) == list(range(self.num_slots, self.num_rows)), (
            "a saved-state row went missing or is held twice"
        )
        if cached_chains is not None:
            assert set(self.saved) <= set(cached_chains), "a saved state outlived its block"
