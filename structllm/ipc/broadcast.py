"""A single-producer, many-consumer byte ring: every reader sees every frame. Sans-IO,
like ``ring`` (whose frame format and data area it shares); ``broadcast_channel`` adds
encoding and waiting.

Layout (``broadcast_ring_size(capacity, num_readers)`` bytes, capacity a power of two)::

    0              tail                u64  bytes produced so far (writer only)
    64             writer_waiting      u64  1 while the writer waits for space
    128 + 128*i    head[i]             u64  bytes reader i has consumed (reader i only)
    192 + 128*i    reader_waiting[i]   u64  1 while reader i sleeps or is about to
    128 + 128*R    data                capacity bytes

Each counter has its own cache line. Readers never write the same line, and the writer
writes only its own two. A frame's bytes can be overwritten only once every reader's
head has passed them, so the writer's free space is ``capacity - (tail - min(head))``:
the slowest reader is back-pressure, never data loss.

Ordering is the SPSC ring's, once per reader: the writer publishes the tail with
``store_release`` after the frame's bytes, a reader loads it with ``load_acquire``
before reading them; a reader publishes its head with ``store_release`` after reading,
and the writer loads every head with ``load_acquire`` before reusing space.
"""

from __future__ import annotations

from structllm.ipc import atomics
from structllm.ipc.ring import _LEN, LEN_SIZE, FrameArea

TAIL, WRITER_WAITING = 0, 64
READER_BASE, READER_STRIDE, READER_WAITING = 128, 128, 64


def broadcast_header_size(num_readers: int) -> int:
    return READER_BASE + READER_STRIDE * num_readers


def broadcast_ring_size(capacity: int, num_readers: int) -> int:
    """Bytes of buffer a broadcast ring of ``capacity`` data bytes needs."""
    return broadcast_header_size(num_readers) + capacity


class BroadcastRing(FrameArea):
    """A view of a broadcast ring in ``buf`` at ``offset`` with ``num_readers`` readers.

    The writer calls ``try_write``; reader ``i`` calls ``try_read(i)``. ``init=True``
    zeroes the header (the writer's side, before anyone attaches). One object may serve
    the writer and every reader in a single thread (tests); across processes each keeps
    its own view and uses only its own role.
    """

    def __init__(
        self, buf: object, capacity: int, num_readers: int, offset: int = 0, init: bool = False
    ) -> None:
        if num_readers < 1:
            raise ValueError(f"a broadcast ring needs at least one reader, got {num_readers}")
        header = broadcast_header_size(num_readers)
        super().__init__(buf, capacity, offset, header)
        self.num_readers = num_readers
        base = self._base
        self._tail_addr = base + TAIL
        self.writer_waiting_addr = base + WRITER_WAITING
        self._head_addrs = [base + READER_BASE + READER_STRIDE * i for i in range(num_readers)]
        self.reader_waiting_addrs = [a + READER_WAITING for a in self._head_addrs]
        if init:
            self._view[offset : offset + header] = bytes(header)
        # Private copies. For the writer, ``_heads`` are lower bounds of the readers'
        # heads (refreshed only when the ring looks full); for reader i, ``_heads[i]`` is
        # its own head and ``_tail`` a lower bound of the writer's tail.
        self._tail = atomics.load_acquire(self._tail_addr)
        self._heads = [atomics.load_acquire(a) for a in self._head_addrs]
        self._slowest = min(self._heads)

    # -- writer ------------------------------------------------------------------------

    def try_write(self, payload: bytes | bytearray | memoryview) -> bool:
        """Append one frame for every reader, or return False (writing nothing) if the
        slowest reader has not freed enough space yet. Raises ``FrameTooLarge`` if the
        frame could never fit."""
        need = LEN_SIZE + len(payload)
        tail = self._tail
        if tail + need - self._slowest > self.capacity:  # taken by any frame larger than the ring
            self._check_fits(need)
            self._refresh_heads()
            if tail + need - self._slowest > self.capacity:
                return False
        self._tail = self._publish(tail, payload)
        return True

    def free_bytes(self) -> int:
        """Space for frames right now (refreshes every reader's head)."""
        self._refresh_heads()
        return self.capacity - (self._tail - self._slowest)

    def lag(self, reader: int) -> int:
        """Bytes written that reader ``reader`` has not consumed yet (as last seen)."""
        return self._tail - self._heads[reader]

    def _refresh_heads(self) -> None:
        self._heads = [atomics.load_acquire(a) for a in self._head_addrs]
        self._slowest = min(self._heads)

    # -- reader i ------------------------------------------------------------------------

    def try_read(self, reader: int) -> bytes | None:
        """Reader ``reader``'s next frame, or None if it has consumed everything."""
        head = self._heads[reader]
        if head == self._tail:
            self._tail = atomics.load_acquire(self._tail_addr)
            if head == self._tail:
                return None
        (n,) = _LEN.unpack(self._get(head, LEN_SIZE))
        frame = self._get(head + LEN_SIZE, n)
        head += LEN_SIZE + n
        self._heads[reader] = head
        self._slowest = min(self._heads)
        atomics.store_release(self._head_addrs[reader], head)
        return frame

    def readable(self, reader: int) -> bool:
        """Whether a frame waits for reader ``reader`` (refreshes the writer's tail)."""
        self._tail = atomics.load_acquire(self._tail_addr)
        return self._tail != self._heads[reader]
