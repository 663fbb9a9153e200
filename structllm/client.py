"""The front end's handle on the engine: request registration, the dispatcher, aborts.

One ``EngineClient`` per engine process. Its dispatcher task is the only reader of the
engine -> front ring; it hands each request its token deltas through a ``RequestStream``,
a non-blocking collector that merges deltas while its consumer lags, so the dispatcher
never waits for a slow client. A supervisor task watches the engine process; when it
dies, every open stream fails with ``EngineDeadError`` and new requests are refused.

``EngineClient.request`` is the one way in: an async context manager that registers the
stream and sends ``AddRequest`` in one step, and on any exit (finished, error,
cancellation) unregisters it and aborts the engine side with a non-blocking put (queued
for the dispatcher to flush if the ring is momentarily full). So a cancellation at any
point leaks nothing in either process.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskStatus

from structllm.launch import EngineProcess
from structllm.protocol import (
    Abort,
    AddRequest,
    EngineError,
    EngineReady,
    EngineStats,
    FinishReason,
    GetStats,
    ImageInput,
    LoraRef,
    OutputBatch,
    PoolingParams,
    SamplingParams,
    TokenLogprobs,
)


class EngineDeadError(RuntimeError):
    """The engine process is gone; in-flight and new requests fail with this."""


class EngineRequestError(ValueError):
    """The engine refused a request (e.g. it can never fit)."""


@dataclass
class Delta:
    """Everything that arrived for one request since the consumer last looked."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    pooled: bytes | None = None  # a pooling request's vector (float32 bytes)


class Wakeup:
    """A resettable signal with one waiter: ``set`` from anywhere, ``wait`` clears it."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = anyio.Event()


class RequestStream:
    """Collector between the dispatcher (``put``, never blocks) and one consumer
    (``take`` / ``get``). Several streams may share one ``Wakeup`` (n > 1 completions of
    one response), so their consumer waits on all of them at once."""

    def __init__(self, request_id: str, wakeup: Wakeup | None = None) -> None:
        self.request_id = request_id
        self.wakeup = wakeup or Wakeup()
        self._pending = Delta()
        self._dirty = False
        self._error: BaseException | None = None
        self.finished = False

    def put(
        self,
        token_ids: list[int],
        logprobs: list[TokenLogprobs] | None,
        finish: FinishReason | None,
        stop_reason: int | None,
        num_cached: int,
        prompt_logprobs: list[TokenLogprobs] | None = None,
        pooled: bytes | None = None,
    ) -> None:
        d = self._pending
        if pooled is not None:
            d.pooled = pooled
        d.token_ids += token_ids
        if logprobs:
            d.logprobs += logprobs
        if prompt_logprobs:
            d.prompt_logprobs += prompt_logprobs
        d.num_cached_tokens = num_cached
        if finish is not None:
            d.finish_reason, d.stop_reason = finish, stop_reason
            self.finished = True
        self._dirty = True
        self.wakeup.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self.finished = True
        self.wakeup.set()

    def take(self) -> Delta | None:
        """Everything pending, or None if nothing arrived. Raises the stream's error."""
        if self._error is not None:
            raise self._error
        if not self._dirty:
            return None
        d, self._pending, self._dirty = self._pending, Delta(), False
        return d

    async def get(self) -> Delta:
        """Wait for and take everything pending (for a stream with its own wakeup)."""
        while (d := self.take()) is None:
            await self.wakeup.wait()
        return d


class EngineClient:
    def __init__(self, engine: EngineProcess, id_prefix: str = "") -> None:
        self.engine = engine
        self.id_prefix = id_prefix  # unique per front-end process sharing one engine
        self.ready: EngineReady = engine.ready
        self.stats = EngineStats()
        self._streams: dict[str, RequestStream] = {}
        self._pending_aborts: list[str] = []
        self._ids = itertools.count()
        self.dead: EngineDeadError | None = None
        self._stats_waiters: list[anyio.Event] = []

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{self.id_prefix}{prefix}-{next(self._ids)}"

    # -- the tasks the owner runs --------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Dispatcher and supervisor; returns when the engine process exits (after
        failing every open stream). Run it in the owner's task group; when its owner
        cancels it (the engine is being stopped), the client is failed too, so that a
        request still open then, or an abort sent after (a background run cancelled
        while the server stops), never touches the rings being released."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._supervise, tg.cancel_scope)
                for msg in self.engine.pending:
                    self._dispatch(msg)
                task_status.started()
                while True:
                    for msg in await self.engine.endpoint.recv():
                        self._dispatch(msg)
                    self._flush_aborts()
        finally:
            if self.dead is None:
                self.fail(EngineDeadError("the engine has stopped"))

    async def _supervise(self, scope: anyio.CancelScope) -> None:
        code = await self.engine.process.wait()
        # Deliver whatever the engine wrote before it went (its last batch, its error).
        for msg in self.engine.endpoint.ep.try_recv():
            self._dispatch(msg)
        self.fail(
            EngineDeadError(
                self.dead.args[0] if self.dead else f"the engine process exited (code {code})"
            )
        )
        scope.cancel()

    def fail(self, error: EngineDeadError) -> None:
        """Fail every open stream and refuse new requests (the engine, or a process this
        client depends on, is gone). Idempotent."""
        self.dead = error
        streams, self._streams = self._streams, {}
        for s in streams.values():
            s.fail(error)
        for ev in self._stats_waiters:
            ev.set()

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, OutputBatch):
            self.stats = msg.stats
            for d in msg.outputs:
                stream = self._streams.get(d.request_id)
                if stream is None:
                    continue  # aborted here already: drop
                if d.finish_reason == "error":
                    del self._streams[d.request_id]
                    stream.fail(EngineRequestError(d.error or "the engine refused the request"))
                    continue
                stream.put(
                    d.new_token_ids,
                    d.logprobs,
                    d.finish_reason,
                    d.stop_reason,
                    d.num_cached_tokens,
                    d.prompt_logprobs,
                    d.pooled,
                )
                if d.finish_reason is not None:
                    del self._streams[d.request_id]
            if self._stats_waiters:
                waiters, self._stats_waiters = self._stats_waiters, []
                for ev in waiters:
                    ev.set()
        elif isinstance(msg, EngineError):
            self.dead = EngineDeadError(f"engine error: {msg.message}")

    # -- requests ----------------------------------------------------------------------

    @asynccontextmanager
    async def request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        wakeup: Wakeup | None = None,
        images: Sequence[ImageInput] = (),
        priority: int = 0,
        lora: LoraRef | None = None,
        pooling: PoolingParams | None = None,
    ) -> AsyncIterator[RequestStream]:
        """Register, send, yield the stream; on exit unregister and abort if unfinished.
        ``images``: the prompt's (``ImageInput`` spans in prompt order); ``priority``:
        lower runs earlier (the engine's priority policy); ``lora``: the LoRA adapter it
        runs with."""
        if self.dead is not None:
            raise self.dead
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, wakeup)
        self._streams[request_id] = stream
        try:
            await self.engine.endpoint.send(
                AddRequest(
                    request_id,
                    prompt_token_ids,
                    sampling,
                    list(images),
                    priority,
                    lora,
                    pooling,
                )
            )
            yield stream
        finally:
            if self._streams.pop(request_id, None) is not None:
                self.abort(request_id)

    def finish_early(self, request_id: str) -> None:
        """The front end ended this request (a stop string): unregister and abort."""
        if self._streams.pop(request_id, None) is not None:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Non-blocking and idempotent. Queued for the dispatcher if the ring is full."""
        if self.dead is not None:
            return
        self._pending_aborts.append(request_id)
        self._flush_aborts()

    def _flush_aborts(self) -> None:
        if self._pending_aborts and self.engine.endpoint.try_send(Abort(self._pending_aborts)):
            self._pending_aborts = []

    async def fresh_stats(self, timeout: float = 1.0) -> EngineStats:
        """Ask the engine for a batch with current stats and wait for it (bounded)."""
        if self.dead is None and self.engine.endpoint.try_send(GetStats()):
            ev = anyio.Event()
            self._stats_waiters.append(ev)
            with anyio.move_on_after(timeout):
                await ev.wait()
        return self.stats
