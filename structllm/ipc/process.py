"""Starting and stopping the engine process from the front end (anyio).

``open_engine`` is an async context manager that owns everything of one engine: the
shared memory, both doorbells, the parent-death pipe and the child process. It spawns
``python -m structllm.engine`` (fork+exec from the event-loop thread, never a bare fork of
this threaded process),
waits for the ``EngineReady`` handshake (or fails with the engine's error, or its exit
code), and on exit shuts the engine down: ``Shutdown`` first, then SIGKILL after a grace
period, always reaping the child and closing every descriptor, also when cancelled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import msgspec

from structllm.config import EngineConfig
from structllm.ipc import shm
from structllm.ipc.async_channel import AsyncEndpoint
from structllm.ipc.channel import Doorbell, Endpoint
from structllm.ipc.ring import Ring
from structllm.protocol import (
    PROTOCOL_VERSION,
    EngineError,
    EngineLaunch,
    EngineReady,
    FromEngine,
    OutputBatch,
    Shutdown,
)

DEFAULT_RING_CAPACITY = 8 << 20


class EngineStartError(RuntimeError):
    """The engine process failed before it was ready."""


class ChildProcess:
    """A child started with ``subprocess.Popen`` from the calling (event-loop) thread.

    Not ``anyio.open_process``: trio forks from a worker thread, and the child's
    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked it exits, which trio's
    thread cache does after a few idle seconds. Exit is awaited through a pidfd.
    """

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid
        self._pidfd = os.pidfd_open(popen.pid)

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    async def wait(self) -> int:
        while self.popen.poll() is None:
            await anyio.wait_readable(self._pidfd)
        return int(self.popen.returncode)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


@dataclass
class EngineProcess:
    """A running engine: its channel and process. ``pending`` holds output batches that
    arrived together with the handshake."""

    endpoint: AsyncEndpoint[FromEngine]
    process: ChildProcess
    ready: EngineReady
    pending: list[FromEngine]

    @property
    def pid(self) -> int:
        return self.process.pid


@asynccontextmanager
async def open_engine(
    config: EngineConfig,
    *,
    ring_capacity: int = DEFAULT_RING_CAPACITY,
    startup_timeout: float = 600.0,
    shutdown_timeout: float = 5.0,
    spin_us: float = 50.0,
    front_spin_us: float = 50.0,
    module: str = "structllm.engine",
) -> AsyncIterator[EngineProcess]:
    size = shm.channel_size(ring_capacity)
    mapping, shm_fd = shm.create(size)
    to_engine, to_front = shm.rings(mapping, ring_capacity, init=True)
    engine_bell, front_bell = Doorbell(), Doorbell()
    pipe_r, pipe_w = os.pipe()
    process: ChildProcess | None = None
    try:
        launch = EngineLaunch(
            protocol_version=PROTOCOL_VERSION,
            config=msgspec.to_builtins(config),
            shm_fd=shm_fd,
            shm_size=size,
            ring_capacity=ring_capacity,
            engine_bell_fd=engine_bell.fd,
            front_bell_fd=front_bell.fd,
            parent_pipe_fd=pipe_r,
            parent_pid=os.getpid(),
            spin_us=spin_us,
        )
        process = ChildProcess(
            subprocess.Popen(
                [sys.executable, "-m", module, msgspec.json.encode(launch).decode()],
                pass_fds=(shm_fd, engine_bell.fd, front_bell.fd, pipe_r),
                stdin=subprocess.DEVNULL,
            )
        )
        # The child holds its copies now; ours are not needed.
        os.close(pipe_r)
        pipe_r = -1
        os.close(shm_fd)
        shm_fd = -1
        endpoint: AsyncEndpoint[FromEngine] = AsyncEndpoint(
            Endpoint(to_front, to_engine, front_bell, engine_bell, FromEngine), spin_s=front_spin_us * 1e-6
        )
        ready, pending = await _handshake(endpoint, process, startup_timeout)
        yield EngineProcess(endpoint, process, ready, pending)
    finally:
        with anyio.CancelScope(shield=True):
            if process is not None:
                await _stop(process, to_engine, engine_bell, shutdown_timeout)
                process.close()
            for fd in (pipe_r, pipe_w, shm_fd):
                if fd >= 0:
                    os.close(fd)
            to_engine.close()
            to_front.close()
            mapping.close()
            engine_bell.close()
            front_bell.close()


async def _handshake(
    endpoint: AsyncEndpoint[FromEngine], process: ChildProcess, timeout: float
) -> tuple[EngineReady, list[FromEngine]]:
    """The first message must be ``EngineReady``; an exit or an ``EngineError`` first is a
    start failure."""
    result: list[FromEngine] = []
    exit_code: int | None = None

    async def watch_exit(scope: anyio.CancelScope) -> None:
        nonlocal exit_code
        exit_code = await process.wait()
        scope.cancel()

    with anyio.move_on_after(timeout) as deadline:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_exit, tg.cancel_scope)
            result = await endpoint.recv()
            tg.cancel_scope.cancel()
    if not result:
        # The engine may have written its error just before exiting.
        result = endpoint.ep.try_recv()
    if result and isinstance(result[0], EngineReady):
        if result[0].protocol_version != PROTOCOL_VERSION:
            raise EngineStartError(f"engine speaks protocol {result[0].protocol_version}, expected {PROTOCOL_VERSION}")
        rest = result[1:]
        assert all(isinstance(m, OutputBatch) for m in rest)
        return result[0], rest
    if result and isinstance(result[0], EngineError):
        raise EngineStartError(result[0].message)
    if deadline.cancelled_caught:
        raise EngineStartError(f"engine was not ready within {timeout:.0f}s")
    raise EngineStartError(f"engine exited with code {exit_code} before it was ready")


async def _stop(process: ChildProcess, to_engine: Ring, bell: Doorbell, timeout: float) -> None:
    """Ask the engine to stop, give it ``timeout`` seconds, then kill it; always reap."""
    if process.returncode is None:
        frame = msgspec.msgpack.encode(Shutdown())
        if to_engine.try_write(frame):
            bell.ring()
        with anyio.move_on_after(timeout):
            await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()
