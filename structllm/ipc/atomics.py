"""The rings' memory-ordering primitives (see ``_atomic.c`` for the argument).

- ``load_acquire(addr)``: read a 64-bit counter written by the other process; later
  reads of the ring cannot move before it.
- ``store_release(addr, value)``: publish a 64-bit counter; earlier writes to the ring
  cannot move after it.
- ``fence()``: full barrier, for the sleep/wake handshake (store my flag, then load the
  other side's counter, and vice versa).

On x86-64 the first two are plain moves and only ``fence`` emits an instruction; on
aarch64 they are LDAR/STLR and DMB. There is no pure-Python fallback on purpose: a
store through a memoryview gives no ordering guarantee on weakly ordered CPUs, and even
on x86-64 the sleep/wake handshake needs the full fence.
"""

from __future__ import annotations

import platform

try:
    from structllm.ipc._atomic import fence, load_acquire, store_release
except ImportError as e:  # pragma: no cover - only when the package was not built
    raise ImportError(
        "structllm.ipc._atomic is not built; install structllm with a C compiler available "
        "(pip install -e .)"
    ) from e

MACHINE = platform.machine().lower()
WEAKLY_ORDERED = MACHINE not in ("x86_64", "amd64", "i386", "i686")

__all__ = ["MACHINE", "WEAKLY_ORDERED", "fence", "load_acquire", "store_release"]
