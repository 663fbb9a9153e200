"""The front end's end of a channel, awaiting inside the event loop (trio or asyncio).

Exactly one task (the dispatcher) calls ``recv``; it is the only waiter on this
process's doorbell, as trio allows one waiter per fd. Tasks that ``send`` while the
outbound ring is full park on an event that the dispatcher sets when it sees space:
the dispatcher also asks the peer to ring when it frees space (``writer_waiting``).
"""

from __future__ import annotations

import os
import time
from typing import Generic

import anyio
import anyio.lowlevel

from structllm.ipc.channel import TIGHT_SPIN_S, Endpoint, M, SpinBudget, spin_window, wake_latency


class AsyncEndpoint(Generic[M]):
    def __init__(self, endpoint: Endpoint[M], spin_s: float = 50e-6) -> None:
        """``spin_s``: the spin window, widened on a machine with slow wake-ups (see
        ``channel.spin_window``); 0 never spins."""
        self.ep = endpoint
        self.spin = SpinBudget(spin_window(spin_s, wake_latency()) if spin_s > 0 else 0.0)
        self._want_space = 0  # largest frame a parked sender waits to write
        self._space = anyio.Event()
        self.space_waits = 0  # times a sender found the ring full (back-pressure)

    def try_send(self, msg: object) -> bool:
        """Non-blocking; for cleanup paths that must not await (aborts)."""
        return self.ep.try_send(msg)

    async def send(self, msg: object) -> None:
        """Write ``msg``; while the ring is full, wait (back-pressure) until the engine
        frees space. Needs the dispatcher running ``recv``. Raises ``FrameTooLarge`` if
        the frame can never fit."""
        frame = self.ep.encode(msg)
        while not self.ep.try_send_bytes(frame):
            self.space_waits += 1
            self._want_space = max(self._want_space, len(frame))
            await self._space.wait()

    def _release_senders(self) -> None:
        if self._want_space and self.ep.can_send(self._want_space):
            self._want_space = 0
            self._space.set()
            self._space = anyio.Event()

    async def recv(self) -> list[M]:
        """The next batch of messages (at least one). Spins cooperatively (yielding to
        other tasks) for the adaptive budget, then sleeps on the doorbell."""
        start: float | None = None
        while True:
            msgs = self.ep.try_recv()
            self._release_senders()
            if msgs:
                if start is not None:
                    self.spin.observe(time.perf_counter() - start)
                return msgs
            if start is None:
                start = time.perf_counter()
            if await self._spin():
                continue
            if self.ep.sleep_begin(want_read=True, want_space=self._want_space):
                try:
                    await anyio.wait_readable(self.ep.bell.fd)
                finally:
                    self.ep.sleep_end()

    async def _spin(self) -> bool:
        """Poll for the budget: a few microseconds without yielding (a reply that is
        already on its way lands well within a scheduler round trip), then yielding to
        other tasks between polls, and the CPU to other processes (the engine may be
        runnable on this very CPU: see ``channel``'s notes on spinning)."""
        budget = self.spin.current
        if budget <= 0:
            return False
        now = time.perf_counter()
        tight_end, end = now + min(budget, TIGHT_SPIN_S), now + budget
        while True:
            if self.ep.inbound.readable() or (
                self._want_space and self.ep.can_send(self._want_space)
            ):
                return True
            now = time.perf_counter()
            if now >= end:
                return False
            if now >= tight_end:
                os.sched_yield()
                await anyio.lowlevel.checkpoint()
