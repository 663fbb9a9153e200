"""The encoder-output cache: a vision tower's output for an image, kept by the image's
content hash (``protocol.ImageInput.hash``: the decoded pixels and the preprocessing
settings) so a repeated image, or a preempted request's recompute, skips the encoder.

Bounded in bytes, least recently used first out. Entries a step still needs are pinned
(``pin``/``unpin_all``), and entries a running request is part-way through are held
(``hold``: a causal family's image span may be split over prefill chunks, each chunk
scattering its own rows, so the image's output must outlive the step that encoded it);
neither is evicted: a step that needs more than the bound holds it over the bound until
the engine's next ``hold`` (after every step) or ``put`` trims it back. The
values are opaque here (the runner stores ``[num_tokens, hidden]`` tensors): no torch,
so the scheduler can ask what is cached (``__contains__``) to count the encoder's work.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Generic, TypeVar

V = TypeVar("V")


class EncoderCache(Generic[V]):
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the encoder cache bound must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, tuple[V, int]] = OrderedDict()  # LRU first
        self.pinned: set[str] = set()
        self.held: frozenset[str] = frozenset()  # images running requests are inside of
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str) -> V | None:
        """The value under ``key`` (now the most recently used), or None; counted."""
        entry = self.entries.get(key)
        if entry is None:
            self.num_misses += 1
            return None
        self.num_hits += 1
        self.entries.move_to_end(key)
        return entry[0]

    def put(self, key: str, value: V, nbytes: int) -> None:
        """Keep ``value`` (``nbytes`` large) under ``key``, pinned until ``unpin_all``,
        evicting unpinned entries, oldest first, while over the bound."""
        old = self.entries.pop(key, None)
        if old is not None:
            self.num_bytes -= old[1]
        self.entries[key] = (value, nbytes)
        self.num_bytes += nbytes
        self.pinned.add(key)
        self._trim()

    def pin(self, key: str) -> None:
        """Keep ``key`` (if held) from eviction until ``unpin_all``."""
        if key in self.entries:
            self.pinned.add(key)

    def unpin_all(self) -> None:
        """The step ended: nothing is pinned. No trim yet: an image the step encoded
        and a request is still inside of is held only once the engine knows it
        (``hold``, after the scheduler's update)."""
        self.pinned.clear()

    def hold(self, keys: Iterable[str]) -> None:
        """Keep exactly ``keys`` (the images running requests have rows of still to
        compute) from eviction until the next ``hold``; trim back to the bound."""
        self.held = frozenset(keys)
        self._trim()

    def clear(self) -> None:
        self.entries.clear()
        self.pinned.clear()
        self.held = frozenset()
        self.num_bytes = 0

    def _trim(self) -> None:
        if self.num_bytes <= self.max_bytes:
            return
        for key in [k for k in self.entries if k not in self.pinned and k not in self.held]:
            _, nbytes = self.entries.pop(key)
            self.num_bytes -= nbytes
            if self.num_bytes <= self.max_bytes:
                return
