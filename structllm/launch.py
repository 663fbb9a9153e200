"""Starting, attaching to and stopping the engine process, from the front end (anyio).

``open_engine`` is an async context manager that owns everything of one engine: the
shared memory, both doorbells, the parent-death pipe and the child process. It spawns
``python -m structllm.engine`` (``ipc.spawn``: fork+exec from the event-loop thread),
waits for the ``EngineReady`` handshake (or fails with the engine's error, or its exit
code), and on exit shuts the engine down: ``Shutdown`` first, then SIGKILL after a grace
period, always reaping the child and closing every descriptor, also when cancelled.
``attach_engine`` is the same for another front-end process (``--api-server-count``),
which speaks to a running engine over a channel handed to it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass

import anyio
import msgspec

from structllm.config import EngineConfig
from structllm.ipc import shm
from structllm.ipc.async_channel import AsyncEndpoint
from structllm.ipc.async_process import ChildProcess, ForeignProcess
from structllm.ipc.channel import Doorbell, Endpoint
from structllm.ipc.ring import Ring
from structllm.ipc.spawn import spawn
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
# a model that takes images: a request carries its images' pixels (uint8, as the
# processor resized and tiled them: 2.4 MB for a Gemma 3 image, up to 13 MB for a
# SmolVLM one of 17 tiles) in one frame. Pages of the ring are touched only as frames
# pass through them, so a text-only workload never makes this resident.
IMAGE_RING_CAPACITY = 64 << 20


class EngineStartError(RuntimeError):
    """The engine process failed before it was ready."""


@dataclass
class EngineProcess:
    """A running engine: this process's channel to it and its process. ``pending`` holds
    output batches that arrived together with the handshake; ``handoffs`` describe the
    channels of other front-end processes."""

    endpoint: AsyncEndpoint[FromEngine]
    process: ChildProcess | ForeignProcess
    ready: EngineReady
    pending: list[FromEngine]
    handoffs: list[ChannelHandoff]

    @property
    def pid(self) -> int:
        return self.process.pid


class ChannelHandoff(msgspec.Struct, frozen=True):
    """What another front-end process needs to speak on channel ``index`` of a running
    engine: the (inheritable) descriptors and the layout. Sent as JSON on its command
    line; the descriptors must be passed along (``pass_fds``)."""

    index: int
    shm_fd: int
    shm_size: int
    ring_capacity: int
    engine_bell_fd: int
    front_bell_fd: int
    engine_pid: int

    @property
    def fds(self) -> tuple[int, int, int]:
        return (self.shm_fd, self.engine_bell_fd, self.front_bell_fd)


@asynccontextmanager
async def open_engine(
    config: EngineConfig,
    *,
    channels: int = 1,
    ring_capacity: int = DEFAULT_RING_CAPACITY,
    startup_timeout: float = 600.0,
    shutdown_timeout: float = 5.0,
    spin_us: float = 50.0,
    front_spin_us: float = 50.0,
    module: str = "structllm.engine",
) -> AsyncIterator[EngineProcess]:
    """Start an engine serving ``channels`` front ends; this process speaks on channel 0
    and ``EngineProcess.handoffs`` describe the others (their descriptors stay open here
    until the engine stops, for the front-end processes to inherit)."""
    size = channels * shm.channel_size(ring_capacity)
    own = ExitStack()  # everything opened here, closed in reverse once the engine is stopped
    fds: set[int] = set()  # descriptors still open here (some are closed early)

    def close_fd(fd: int) -> None:
        if fd in fds:
            fds.remove(fd)
            os.close(fd)

    def close_fds() -> None:
        for fd in list(fds):
            close_fd(fd)

    own.callback(close_fds)
    process: ChildProcess | None = None
    try:
        mapping, shm_fd = shm.create(size)
        fds.add(shm_fd)
        own.callback(mapping.close)
        chans = []
        for i in range(channels):
            pair = shm.rings(mapping, ring_capacity, init=True, channel=i)
            own.callback(pair[0].close)  # views of the mapping: released before it closes
            own.callback(pair[1].close)
            chans.append(pair)
        to_engine, to_front = chans[0]
        engine_bell = own.enter_context(contextlib.closing(Doorbell()))
        front_bells = [own.enter_context(contextlib.closing(Doorbell())) for _ in range(channels)]
        pipe_r, pipe_w = os.pipe()
        fds.update((pipe_r, pipe_w))
        launch = EngineLaunch(
            protocol_version=PROTOCOL_VERSION,
            config=msgspec.to_builtins(config),
            shm_fd=shm_fd,
            shm_size=size,
            ring_capacity=ring_capacity,
            engine_bell_fd=engine_bell.fd,
            front_bell_fds=[b.fd for b in front_bells],
            parent_pipe_fd=pipe_r,
            parent_pid=os.getpid(),
            spin_us=spin_us,
        )
        process = ChildProcess(
            spawn(module, launch, (shm_fd, engine_bell.fd, pipe_r, *(b.fd for b in front_bells)))
        )
        # The child holds its copies now; ours are not needed (but for handoffs).
        close_fd(pipe_r)
        if channels == 1:
            close_fd(shm_fd)
        endpoint: AsyncEndpoint[FromEngine] = AsyncEndpoint(
            Endpoint(to_front, to_engine, front_bells[0], engine_bell, FromEngine),
            spin_s=front_spin_us * 1e-6,
        )
        ready, pending = await _handshake(endpoint, process, startup_timeout)
        handoffs = [
            ChannelHandoff(
                i, shm_fd, size, ring_capacity, engine_bell.fd, front_bells[i].fd, process.pid
            )
            for i in range(1, channels)
        ]
        yield EngineProcess(endpoint, process, ready, pending, handoffs)
    finally:
        with anyio.CancelScope(shield=True):
            if process is not None:
                await _stop(process, to_engine, engine_bell, shutdown_timeout)
                process.close()
            own.close()


@asynccontextmanager
async def attach_engine(
    handoff: ChannelHandoff, startup_timeout: float = 600.0, front_spin_us: float = 50.0
) -> AsyncIterator[EngineProcess]:
    """The other side of a ``ChannelHandoff``, in another front-end process: this
    process does not own the engine (it cannot reap it), but sees it die (pidfd)."""
    own = ExitStack()  # the handed-over descriptors and what is opened here, closed in reverse
    try:
        engine_bell = own.enter_context(contextlib.closing(Doorbell(handoff.engine_bell_fd)))
        front_bell = own.enter_context(contextlib.closing(Doorbell(handoff.front_bell_fd)))
        try:
            mapping = shm.attach(handoff.shm_fd, handoff.shm_size)
        finally:
            os.close(handoff.shm_fd)
        own.callback(mapping.close)
        to_engine, to_front = shm.rings(mapping, handoff.ring_capacity, channel=handoff.index)
        own.callback(to_engine.close)  # views of the mapping: released before it closes
        own.callback(to_front.close)
        process = own.enter_context(contextlib.closing(ForeignProcess(handoff.engine_pid)))
        endpoint: AsyncEndpoint[FromEngine] = AsyncEndpoint(
            Endpoint(to_front, to_engine, front_bell, engine_bell, FromEngine),
            spin_s=front_spin_us * 1e-6,
        )
        ready, pending = await _handshake(endpoint, process, startup_timeout)
        yield EngineProcess(endpoint, process, ready, pending, [])
    finally:
        own.close()


async def _handshake(
    endpoint: AsyncEndpoint[FromEngine], process: ChildProcess | ForeignProcess, timeout: float
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
            raise EngineStartError(
                f"engine speaks protocol {result[0].protocol_version}, expected {PROTOCOL_VERSION}"
            )
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
