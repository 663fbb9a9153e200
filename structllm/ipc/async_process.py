"""Awaiting processes' exits in the front end (anyio), through pidfds.

``ChildProcess`` wraps a ``spawn.Child`` of this process (its exit code is collected);
``ForeignProcess`` watches a process this one did not start (the engine, seen from
another front end), whose exit can be seen but not reaped.
"""

from __future__ import annotations

import os

import anyio

from structllm.ipc.spawn import Child


class _ExitWatch:
    """Waits for a pidfd to turn readable (the process exited), for any number of tasks:
    trio allows one waiter per fd, so the first watches and the others wait on it."""

    def __init__(self, pidfd: int) -> None:
        self.pidfd = pidfd
        self.done = False
        self._event: anyio.Event | None = None

    async def wait(self) -> None:
        while not self.done:
            if self._event is not None:
                await self._event.wait()  # the watcher finished or was cancelled: look again
                continue
            self._event = event = anyio.Event()
            try:
                await anyio.wait_readable(self.pidfd)
                self.done = True
            finally:
                self._event = None
                event.set()


class ForeignProcess:
    """A process this one did not start (the engine, seen from another front end):
    its exit is observed through a pidfd; there is no exit code to collect."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd = os.pidfd_open(pid)
        self._exit = _ExitWatch(self._pidfd)

    async def wait(self) -> int:
        await self._exit.wait()
        return -1

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


class ChildProcess:
    """A ``spawn.Child`` whose exit can be awaited (through its pidfd). Owned like the
    ``Child``: ``close`` (kill if running, reap, close the pidfd) in a ``finally``."""

    def __init__(self, child: Child) -> None:
        self.child = child
        self.pid = child.pid
        self._exit = _ExitWatch(child.pidfd)

    @property
    def returncode(self) -> int | None:
        return self.child.returncode

    async def wait(self) -> int:
        if self.child.returncode is None:
            await self._exit.wait()
        return self.child.wait()

    def kill(self) -> None:
        self.child.kill()

    def terminate(self) -> None:
        if self.child.returncode is None:
            self.child.popen.terminate()

    def close(self) -> None:
        self.child.close()
