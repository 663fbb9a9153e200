"""Frame payloads for the ring tests."""

from __future__ import annotations


def frame(i: int, n: int) -> bytes:
    """Frame ``i`` of ``n`` bytes: a pattern that differs from frame to frame, so loss,
    reordering and corruption show."""
    return bytes((i * 31 + k) % 251 for k in range(n))
