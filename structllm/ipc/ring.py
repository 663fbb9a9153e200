"""A single-producer single-consumer byte ring over a shared buffer. Sans-IO: no
waiting, no encoding, no syscalls; ``channel`` adds those.

Layout of the buffer (``ring_size(capacity)`` bytes, capacity a power of two)::

    0    head            u64  bytes consumed so far (written by the consumer only)
    64   tail            u64  bytes produced so far (written by the producer only)
    128  reader_waiting  u64  1 while the consumer sleeps or is about to
    192  writer_waiting  u64  1 while the producer waits for space
    256  data            capacity bytes

Each counter has its own cache line, so the two sides never write the same line.
Counters increase monotonically (2**64 bytes will not wrap in practice); the byte
``n`` lives at ``data[n % capacity]``. A frame is a 4-byte little-endian length and the
payload; both may wrap around the end of the data area. ``tail - head`` is the bytes in
use, so "full" and "empty" are never confused.

Ordering: the producer writes the frame, then publishes the tail; the consumer reads the
tail, then the frame; symmetrically for the head and the freed space. Every publish
goes through ``atomics.store_release`` and every read of the other side's counter
through ``atomics.load_acquire`` (see ``_atomic.c`` for why that suffices and what it
costs on x86-64 and aarch64). Each side keeps a private copy of the other side's
counter and refreshes it only when the copy says "full" or "empty".
"""

from __future__ import annotations

import ctypes
import struct

from structllm.ipc import atomics

HEAD, TAIL, READER_WAITING, WRITER_WAITING = 0, 64, 128, 192
HEADER_SIZE = 256
LEN_SIZE = 4
_LEN = struct.Struct("<I")


class FrameTooLarge(ValueError):
    """A frame can never fit in this ring."""


def ring_size(capacity: int) -> int:
    """Bytes of buffer a ring of ``capacity`` data bytes needs."""
    return HEADER_SIZE + capacity


class FrameArea:
    """The data area of a ring in ``buf`` at ``offset``: a header of ``header_size`` bytes
    (counters, owned by the subclass), then ``capacity`` data bytes. Byte ``n`` of the
    stream lives at ``data[n % capacity]``; ``_put``/``_get`` copy across the wrap.
    Shared by ``Ring`` and ``broadcast.BroadcastRing``."""

    def __init__(self, buf: object, capacity: int, offset: int, header_size: int) -> None:
        if capacity < 8 or capacity & (capacity - 1):
            raise ValueError(f"ring capacity must be a power of two >= 8, got {capacity}")
        view = memoryview(buf).cast("B")  # type: ignore[arg-type]
        total = header_size + capacity
        if view.readonly or len(view) < offset + total:
            raise ValueError(f"ring needs {total} writable bytes at offset {offset}")
        self.capacity = capacity
        self._mask = capacity - 1
        self._view = view
        self._data = view[offset + header_size : offset + total]
        # A ctypes object pins the buffer (an mmap cannot be closed under it) and gives
        # the address of the counters for the C atomics.
        self._pin = ctypes.c_char.from_buffer(view, offset)
        self._base = ctypes.addressof(self._pin)
        if (
            self._base % 8
        ):  # the atomics need 8; a page-aligned mapping also gives each counter its own line
            raise ValueError("ring header must be 8-byte aligned")

    def close(self) -> None:
        """Release the views so the underlying buffer can be closed."""
        del self._pin
        self._data.release()
        self._view.release()

    _tail_addr: int  # the subclass's tail counter

    def _check_fits(self, need: int) -> None:
        """Raise ``FrameTooLarge`` if a frame of ``need`` bytes could never fit. Writers
        call it only on their ring-looks-full path: such a frame always lands there."""
        if need > self.capacity:
            n = need - LEN_SIZE
            raise FrameTooLarge(
                f"frame of {n} bytes (+{LEN_SIZE} length) exceeds the ring capacity "
                f"of {self.capacity} bytes"
            )

    def _publish(self, tail: int, payload: bytes | bytearray | memoryview) -> int:
        """Copy one frame in at ``tail`` (the caller has checked the space), then publish
        the new tail with a release store, so a reader that acquires it sees the bytes.
        Returns the new tail."""
        self._put(tail, _LEN.pack(len(payload)))
        self._put(tail + LEN_SIZE, payload)
        tail += LEN_SIZE + len(payload)
        atomics.store_release(self._tail_addr, tail)
        return tail

    def _put(self, pos: int, data: bytes | bytearray | memoryview) -> None:
        start = pos & self._mask
        n = len(data)
        first = min(n, self.capacity - start)
        self._data[start : start + first] = data[:first] if first < n else data
        if first < n:
            self._data[: n - first] = data[first:]

    def _get(self, pos: int, n: int) -> bytes:
        start = pos & self._mask
        end = start + n
        if end <= self.capacity:
            return self._data[start:end].tobytes()
        return self._data[start:].tobytes() + self._data[: end - self.capacity].tobytes()


class Ring(FrameArea):
    """One end's view of a ring in ``buf`` (a writable buffer such as an ``mmap``, or a
    ``bytearray`` in tests) starting at ``offset``.

    ``init=True`` zeroes the header; exactly one side does that, before the other side
    attaches. The same object may be used for both ends in a single thread (tests).
    """

    def __init__(self, buf: object, capacity: int, offset: int = 0, init: bool = False) -> None:
        super().__init__(buf, capacity, offset, HEADER_SIZE)
        base = self._base
        self._head_addr = base + HEAD
        self._tail_addr = base + TAIL
        self.reader_waiting_addr = base + READER_WAITING
        self.writer_waiting_addr = base + WRITER_WAITING
        if init:
            self._view[offset : offset + HEADER_SIZE] = bytes(HEADER_SIZE)
        # private copies: what this end knows about the counters
        self._head = atomics.load_acquire(self._head_addr)
        self._tail = atomics.load_acquire(self._tail_addr)

    # -- producer ----------------------------------------------------------------------

    def try_write(self, payload: bytes | bytearray | memoryview) -> bool:
        """Append one frame, or return False (writing nothing) if it does not fit now.
        Raises ``FrameTooLarge`` if it could never fit."""
        need = LEN_SIZE + len(payload)
        tail = self._tail
        if tail + need - self._head > self.capacity:  # taken by any frame larger than the ring
            self._check_fits(need)
            self._head = atomics.load_acquire(self._head_addr)
            if tail + need - self._head > self.capacity:
                return False
        self._tail = self._publish(tail, payload)
        return True

    def free_bytes(self) -> int:
        """Space for frames right now (refreshes the consumer's counter)."""
        self._head = atomics.load_acquire(self._head_addr)
        return self.capacity - (self._tail - self._head)

    # -- consumer ----------------------------------------------------------------------

    def try_read(self) -> bytes | None:
        """Remove and return the oldest frame, or None if the ring is empty."""
        head = self._head
        if head == self._tail:
            self._tail = atomics.load_acquire(self._tail_addr)
            if head == self._tail:
                return None
        (n,) = _LEN.unpack(self._get(head, LEN_SIZE))
        frame = self._get(head + LEN_SIZE, n)
        self._head = head + LEN_SIZE + n
        atomics.store_release(self._head_addr, self._head)
        return frame

    def read_many(self, limit: int) -> list[bytes]:
        """Remove and return up to ``limit`` frames, publishing the head once."""
        frames: list[bytes] = []
        head = self._head
        if head == self._tail:
            self._tail = atomics.load_acquire(self._tail_addr)
        tail = self._tail
        while head != tail and len(frames) < limit:
            (n,) = _LEN.unpack(self._get(head, LEN_SIZE))
            frames.append(self._get(head + LEN_SIZE, n))
            head += LEN_SIZE + n
        if head != self._head:
            self._head = head
            atomics.store_release(self._head_addr, head)
        return frames

    def readable(self) -> bool:
        """Whether a frame is waiting (refreshes the producer's counter)."""
        self._tail = atomics.load_acquire(self._tail_addr)
        return self._tail != self._head
