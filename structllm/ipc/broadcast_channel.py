"""Framing and waiting on a broadcast ring: one ``Publisher``, one ``Subscriber`` per
reader process.

Waking follows ``channel``'s protocol, per reader. A subscriber about to sleep sets its
``reader_waiting`` flag, fences, and looks once more before sleeping on its own doorbell;
the publisher, after publishing a frame, fences and rings the doorbell of every reader
whose flag is set. When the ring is full the publisher sets ``writer_waiting`` and sleeps
on its doorbell, which a subscriber rings after freeing space while that flag is set.
With a fence on both sides of each handshake no wake-up is missed.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable
from typing import Generic

import msgspec

from structllm.ipc import atomics
from structllm.ipc.broadcast import BroadcastRing
from structllm.ipc.channel import Doorbell, M, ProtocolError, SpinBudget
from structllm.ipc.ring import LEN_SIZE


class Publisher:
    """The writer's end: encodes with msgspec, publishes, wakes sleeping readers.
    ``reader_bells[i]`` is reader i's doorbell; ``bell`` is the writer's own."""

    def __init__(self, ring: BroadcastRing, reader_bells: list[Doorbell], bell: Doorbell) -> None:
        if len(reader_bells) != ring.num_readers:
            raise ValueError(f"{len(reader_bells)} doorbells for {ring.num_readers} readers")
        self.ring = ring
        self.reader_bells = reader_bells
        self.bell = bell
        self._encoder = msgspec.msgpack.Encoder()
        self.space_waits = 0  # times the slowest reader held the writer back

    def try_publish_bytes(self, frame: bytes) -> bool:
        """Write one encoded frame if it fits now; wakes the readers that sleep."""
        if not self.ring.try_write(frame):
            return False
        atomics.fence()  # publish (tail) before reading the readers' flags
        for addr, bell in zip(self.ring.reader_waiting_addrs, self.reader_bells, strict=True):
            if atomics.load_acquire(addr):
                bell.ring()
        return True

    def publish(
        self,
        msg: object,
        timeout: float = 0.1,
        check: Callable[[], None] | None = None,
        extra_fds: tuple[int, ...] = (),
    ) -> None:
        """Write ``msg``, waiting while the slowest reader frees space (back-pressure).
        Between waits, ``check`` runs (e.g. to raise if a reader died); the waits also end
        when an ``extra_fds`` entry becomes readable."""
        frame = self._encoder.encode(msg)
        while not self.try_publish_bytes(frame):
            self.space_waits += 1
            if check is not None:
                check()
            self._wait_for_space(LEN_SIZE + len(frame), timeout, extra_fds)

    def _wait_for_space(self, need: int, timeout: float, extra_fds: tuple[int, ...]) -> None:
        ring = self.ring
        atomics.store_release(ring.writer_waiting_addr, 1)
        atomics.fence()  # the flag before the re-check
        try:
            if ring.free_bytes() >= need:
                return
            poller = select.poll()
            poller.register(self.bell.fd, select.POLLIN)
            for fd in extra_fds:
                poller.register(fd, select.POLLIN | select.POLLHUP)
            poller.poll(max(0, int(timeout * 1000)))
        finally:
            atomics.store_release(ring.writer_waiting_addr, 0)
            self.bell.drain()


class Subscriber(Generic[M]):
    """Reader ``index``'s end: waits on its ``bell``, decodes frames to ``recv_type``, and
    rings the writer's ``writer_bell`` when it frees space the writer waits for."""

    def __init__(
        self,
        ring: BroadcastRing,
        index: int,
        bell: Doorbell,
        writer_bell: Doorbell,
        recv_type: object,
    ) -> None:
        if not 0 <= index < ring.num_readers:
            raise ValueError(f"reader index {index} out of range for {ring.num_readers} readers")
        self.ring = ring
        self.index = index
        self.bell = bell
        self.writer_bell = writer_bell
        self._decoder: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(recv_type)
        self._waiting_addr = ring.reader_waiting_addrs[index]

    def try_recv(self) -> M | None:
        """The next message, or None if none is waiting. A frame that does not decode
        raises ``ProtocolError``: the only writer is trusted, so it is a bug."""
        frame = self.ring.try_read(self.index)
        if frame is None:
            return None
        atomics.fence()  # publish (head) before reading the writer's flag
        if atomics.load_acquire(self.ring.writer_waiting_addr):
            self.writer_bell.ring()
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ProtocolError(f"malformed broadcast frame of {len(frame)} bytes: {e}") from None

    def recv(
        self,
        spin: SpinBudget | None = None,
        timeout: float = 1.0,
        idle: Callable[[], None] | None = None,
    ) -> M:
        """Block until a message arrives: spin for ``spin``'s budget, then sleep on the
        doorbell, waking at least every ``timeout`` seconds to run ``idle`` (which may
        raise, e.g. when the writer's process is gone)."""
        msg = self.try_recv()
        if msg is not None:
            return msg
        start = time.perf_counter()
        if spin is not None and spin.current > 0:
            end = start + spin.current
            while time.perf_counter() < end:
                if self.ring.readable(self.index):
                    spin.observe(time.perf_counter() - start)
                    return self._take()
                os.sched_yield()  # the writer may need this CPU (see channel's spin notes)
        while True:
            if self._sleep(timeout):
                if spin is not None:
                    spin.observe(time.perf_counter() - start)
                return self._take()
            if idle is not None:
                idle()

    def _take(self) -> M:
        msg = self.try_recv()
        assert msg is not None, "a readable ring yielded no frame"
        return msg

    def _sleep(self, timeout: float) -> bool:
        """Sleep until rung or ``timeout``; returns whether a frame is waiting."""
        atomics.store_release(self._waiting_addr, 1)
        atomics.fence()  # the flag before the re-check
        try:
            if self.ring.readable(self.index):
                return True
            poller = select.poll()
            poller.register(self.bell.fd, select.POLLIN)
            poller.poll(max(0, int(timeout * 1000)))
            return self.ring.readable(self.index)
        finally:
            atomics.store_release(self._waiting_addr, 0)
            self.bell.drain()
