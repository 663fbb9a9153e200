"""The shared memory behind a channel: created private, named for an instant.

The front end creates a POSIX shared-memory object (``posix_ipc``) under an unguessable
name with mode 0600, maps it, and unlinks the name at once; the engine inherits the file
descriptor (fork+exec with ``pass_fds``) and maps that. So the name exists only between
two syscalls of the parent: a ``kill -9`` of either process at any later moment leaves
nothing in ``/dev/shm``, and the kernel frees the memory when the last mapping goes.
"""

from __future__ import annotations

import mmap
import os
import secrets

from structllm.ipc.ring import Ring, ring_size

SHM_PREFIX = "/structllm-"


def create(size: int) -> tuple[mmap.mmap, int]:
    """A new private mapping of ``size`` bytes and its (inheritable) file descriptor."""
    import posix_ipc

    name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(12)}"
    shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        mapping = mmap.mmap(shm.fd, size)
    except BaseException:
        shm.close_fd()
        raise
    finally:
        shm.unlink()
    os.set_inheritable(shm.fd, True)
    return mapping, shm.fd


def attach(fd: int, size: int) -> mmap.mmap:
    """Map an inherited descriptor (then it can be closed)."""
    if os.fstat(fd).st_size < size:
        raise ValueError(f"shared memory is {os.fstat(fd).st_size} bytes, expected {size}")
    return mmap.mmap(fd, size)


def channel_size(capacity: int) -> int:
    """Bytes for two rings of ``capacity``: front -> engine, then engine -> front."""
    return 2 * ring_size(capacity)


def rings(
    mapping: mmap.mmap, capacity: int, init: bool = False, channel: int = 0
) -> tuple[Ring, Ring]:
    """``(to_engine, to_front)`` views of channel ``channel`` of a mapping."""
    base = channel * channel_size(capacity)
    return Ring(mapping, capacity, base, init), Ring(
        mapping, capacity, base + ring_size(capacity), init
    )
