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
import statistics
import threading
import time
from collections.abc import Callable
from functools import cache
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


# A wait longer than this many spin windows is the peer being idle, not busy: only
# such waits shrink the budget (see SpinBudget).
IDLE_WAIT_WINDOWS = 4
TIGHT_SPIN_S = 5e-6  # the front end's spin polls this long before yielding to its event loop
SPIN_CAP_S = 500e-6  # no machine gets a longer spin window than this, whatever a wake-up costs
WAKE_SPIN_FACTOR = 2  # the window covers a peer's wake-up and its turnaround


class SpinBudget:
    """How long to poll before sleeping, adapted to recent traffic. Sans-IO: the caller
    reports how long each wait lasted in all (spinning and sleeping).

    A wait of up to ``IDLE_WAIT_WINDOWS`` windows (``max_s``) means the peer is busy
    answering: the budget doubles, up to ``max_s``. A longer one means the peer was
    idle, and a spin would not have caught it: the budget halves, down to ``max_s /
    64``, so an idle channel costs next to no CPU.

    Why not halve on every wait longer than one window. Where a wake-up costs about as
    much as the window (a VM: 78 us against 50 us), a single late reply makes the other
    side sleep; each side's wait then holds the other's wake-up and exceeds the window,
    so both budgets fell to the floor, every round trip took two slow wake-ups, and no
    spin ever caught a message again: spinning lost to not spinning at all (512 against
    198 us). A busy peer's waits now keep the budget up, so one side's spin outlasts the
    other's wake-up (the window is at least ``WAKE_SPIN_FACTOR`` wake-ups, see
    ``spin_window``) and the next round trip is caught. ``max_s == 0`` never spins."""

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s
        self.min_s = max_s / 64
        self.current = max_s

    def observe(self, waited_s: float) -> None:
        if waited_s <= IDLE_WAIT_WINDOWS * self.max_s:
            self.current = min(self.max_s, self.current * 2)
        else:
            self.current = max(self.min_s, self.current / 2)


def spin_window(configured_s: float, wake_s: float) -> float:
    """The spin window for a machine whose wake-ups take ``wake_s``: the configured
    one, widened to ``WAKE_SPIN_FACTOR`` wake-ups (the classic rule: spinning about as
    long as blocking costs is never much worse than either) and capped at
    ``SPIN_CAP_S``. A spin shorter than a wake-up can never outlast the peer's, so two
    sleepy sides never catch each other again. ``configured_s == 0`` (spinning off)
    stays 0."""
    if configured_s <= 0:
        return 0.0
    return min(max(configured_s, WAKE_SPIN_FACTOR * wake_s), max(configured_s, SPIN_CAP_S))


# Spin loops give the CPU away between polls (``os.sched_yield``, about a microsecond
# when nobody else wants the CPU). The peer we wait for may be runnable on this very
# CPU (two cores, other load, wake-affine placement): a spin that kept the CPU held the
# peer off for the whole window, each hop of a round trip cost a full window, and
# spinning lost to sleeping (125 against 14 us on a loaded 2-core VM here, 512 against
# 198 us on issue 13's). The engine side yields from its first poll: a tight start
# (TIGHT_SPIN_S, as the front end has, whose event loop must not be held) measured
# 22-25 us where yielding at once gave 17-20 us, the peers sharing a CPU.


@cache
def wake_latency(samples: int = 15) -> float:
    """This machine's wake-up cost: the median time from an eventfd write to a thread
    asleep on it running again (each sample ~1 ms of sleep; measured once per process).
    About 10-20 us on bare metal, 78 us on the VM of issue 13."""
    fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    sent: list[float] = []
    lags: list[float] = []
    woke = threading.Event()

    def sleeper() -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        for _ in range(samples):
            poller.poll(1000)
            lags.append(time.perf_counter() - sent[-1])
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(fd)
            woke.set()

    thread = threading.Thread(target=sleeper, name="structllm-wake-probe", daemon=True)
    thread.start()
    try:
        for _ in range(samples):
            time.sleep(0.001)  # long enough for the sleeper to be asleep (its CPU idle)
            woke.clear()
            sent.append(time.perf_counter())
            os.eventfd_write(fd, 1)
            woke.wait(1.0)  # blocks: the sleeper has the GIL to itself when it wakes
        thread.join(1.0)
    finally:
        os.close(fd)
    return statistics.median(lags) if lags else 0.0


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
        return (want_read and self.inbound.readable()) or bool(
            want_space and self.can_send(want_space)
        )

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

    def send_blocking(
        self, msg: object, timeout: float = 0.1, check: Callable[[], None] | None = None
    ) -> None:
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
            os.sched_yield()  # see the notes on spinning above wake_latency
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
