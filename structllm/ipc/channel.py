"""Framing and waiting on top of two rings: one process's end of a duplex channel.

An ``Endpoint`` reads frames from ``inbound`` and writes frames to ``outbound``, encoding
with msgspec (one reused encoder, one decoder of a tagged union). It never blocks here;
the engine's blocking wait and the front end's async wait (``async_channel``) build on
``sleep_begin`` / ``sleep_end``.

Waking. Each process has one doorbell (an eventfd) that the other process rings. A side
that is about to sleep sets ``reader_waiting`` on its inbound ring (and
``writer_waiting`` on its outbound ring if it waits for space), issues a full fence,
then looks at the rings once more; only if still nothing can proceed does it sleep. A
side that publishes a frame (or frees space) fences, then rings the peer's doorbell
only if the matching flag is set. With both fences, either the sleeper sees the new
data on its re-check or the publisher sees the flag: no missed wake-up, and no syscall
while the peer is awake.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

from structllm.ipc import atomics
from structllm.ipc.ring import LEN_SIZE, Ring

log = logging.getLogger(__name__)

M = TypeVar("M")


class ProtocolError(Exception):
    """A frame that does not decode to a known message."""


class Doorbell:
    """An eventfd. ``ring`` adds one; the owner waits for it to be readable and drains it."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = fd if fd is not None else os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def ring(self) -> None:
        os.eventfd_write(self.fd, 1)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SpinBudget:
    """How long to poll before sleeping, adapted to recent traffic. After each wait the
    caller reports how long it lasted in all (spinning and sleeping): a wait short
    enough that a full spin would have caught it doubles the budget, a longer one halves
    it, within ``[max_s / 64, max_s]``. Judging by the whole wait, not by whether the
    spin caught it, lets the budget recover after a slow patch (otherwise both sides of
    a ping-pong fall asleep, every wake-up takes the slow path, and no spin ever wins
    again). ``max_s == 0`` never spins."""

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s
        self.min_s = max_s / 64
        self.current = max_s

    def observe(self, waited_s: float) -> None:
        if waited_s <= self.max_s:
            self.current = min(self.max_s, self.current * 2)
        else:
            self.current = max(self.min_s, self.current / 2)


class Endpoint(Generic[M]):
    """``inbound``/``outbound`` rings, this process's ``bell`` and the peer's
    ``peer_bell``; incoming frames decode to ``recv_type`` (a tagged union)."""

    def __init__(
        self,
        inbound: Ring,
        outbound: Ring,
        bell: Doorbell,
        peer_bell: Doorbell,
        recv_type: Any,
        on_protocol_error: Callable[[ProtocolError], None] | None = None,
    ) -> None:
        self.inbound, self.outbound = inbound, outbound
        self.bell, self.peer_bell = bell, peer_bell
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(recv_type)
        self.on_protocol_error = on_protocol_error or (lambda e: log.error("%s", e))
        self.protocol_errors = 0
        self.space_spin = SpinBudget(50e-6)  # for send_blocking: space usually frees fast

    # -- sending -----------------------------------------------------------------------

    def encode(self, msg: object) -> bytes:
        return self._encoder.encode(msg)

    def try_send_bytes(self, frame: bytes) -> bool:
        """Write one encoded frame if it fits now; wakes a sleeping peer."""
        if not self.outbound.try_write(frame):
            return False
        atomics.fence()  # publish (tail) before reading the peer's flag
        if atomics.load_acquire(self.outbound.reader_waiting_addr):
            self.peer_bell.ring()
        return True

    def try_send(self, msg: object) -> bool:
        return self.try_send_bytes(self._encoder.encode(msg))

    def can_send(self, nbytes: int) -> bool:
        return self.outbound.free_bytes() >= nbytes + LEN_SIZE

    # -- receiving ---------------------------------------------------------------------

    def try_recv_bytes(self, limit: int = 1 << 30) -> list[bytes]:
        """Take up to ``limit`` waiting frames, undecoded; wakes a peer waiting for space."""
        frames = self.inbound.read_many(limit)
        if frames:
            atomics.fence()  # publish (head) before reading the peer's flag
            if atomics.load_acquire(self.inbound.writer_waiting_addr):
                self.peer_bell.ring()
        return frames

    def try_recv(self, limit: int = 1 << 30) -> list[M]:
        """Decode every waiting frame (up to ``limit``). A frame that does not decode is
        counted and reported through ``on_protocol_error``; reading goes on."""
        out: list[M] = []
        for frame in self.try_recv_bytes(limit):
            try:
                out.append(self._decoder.decode(frame))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.protocol_errors += 1
                self.on_protocol_error(ProtocolError(f"malformed frame of {len(frame)} bytes: {e}"))
        return out

    # -- sleeping ----------------------------------------------------------------------

    def ready(self, want_read: bool, want_space: int) -> bool:
        return (want_read and self.inbound.readable()) or bool(want_space and self.can_send(want_space))

    def sleep_begin(self, want_read: bool = True, want_space: int = 0) -> bool:
        """Announce that this side is going to sleep until a frame arrives (``want_read``)
        or ``want_space`` bytes are free in ``outbound``. Returns False, announcing
        nothing, if that is already the case: then do not sleep."""
        if want_read:
            atomics.store_release(self.inbound.reader_waiting_addr, 1)
        if want_space:
            atomics.store_release(self.outbound.writer_waiting_addr, 1)
        atomics.fence()  # the flags before the re-check
        if self.ready(want_read, want_space):
            self.sleep_end()
            return False
        return True

    def sleep_end(self) -> None:
        atomics.store_release(self.inbound.reader_waiting_addr, 0)
        atomics.store_release(self.outbound.writer_waiting_addr, 0)
        self.bell.drain()

    # -- blocking waits (the engine side) ---------------------------------------------

    def wait(
        self,
        timeout: float,
        spin: SpinBudget | None = None,
        want_read: bool = True,
        want_space: int = 0,
        extra_fds: tuple[int, ...] = (),
    ) -> list[int]:
        """Block until a frame arrives (``want_read``), ``want_space`` bytes are free, an
        ``extra_fds`` entry is readable, or ``timeout`` seconds pass. Spins first for
        ``spin``'s budget. Returns the ready ``extra_fds``."""
        return wait_any([self], timeout, spin, want_read, want_space, extra_fds)

    def send_blocking(self, msg: object, timeout: float = 0.1, check: Callable[[], None] | None = None) -> None:
        """Write ``msg``, waiting for space while the peer drains the ring (back-pressure).
        ``check`` runs between waits (e.g. to raise if the peer is gone)."""
        frame = self._encoder.encode(msg)
        while not self.try_send_bytes(frame):
            if check is not None:
                check()
            self.wait(timeout, self.space_spin, want_read=False, want_space=len(frame))


def wait_any(
    endpoints: list[Endpoint[Any]],
    timeout: float,
    spin: SpinBudget | None = None,
    want_read: bool = True,
    want_space: int = 0,
    extra_fds: tuple[int, ...] = (),
) -> list[int]:
    """``Endpoint.wait`` over several endpoints that share one doorbell (the engine
    serving several front ends): wakes when any of them is ready."""

    def ready() -> bool:
        return any(ep.ready(want_read, want_space) for ep in endpoints)

    start = time.perf_counter()
    if spin is not None and spin.current > 0:
        end = start + spin.current
        while time.perf_counter() < end:
            if ready():
                spin.observe(time.perf_counter() - start)
                return []
    started = []
    try:
        for ep in endpoints:
            if not ep.sleep_begin(want_read, want_space):
                return []
            started.append(ep)
        poller = select.poll()
        poller.register(endpoints[0].bell.fd, select.POLLIN)
        for fd in extra_fds:
            poller.register(fd, select.POLLIN | select.POLLHUP)
        events = poller.poll(max(0, int(timeout * 1000)))
    finally:
        for ep in started:
            ep.sleep_end()
        if spin is not None:
            spin.observe(time.perf_counter() - start)
    return [fd for fd, _ in events if fd != endpoints[0].bell.fd]
