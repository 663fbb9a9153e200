"""One generation response: admission, its engine requests, and writing it out.

``generate`` owns a task group of three tasks, and everything a response holds has
that group as its owner:

    generate
    ├── respond            engine requests (EngineClient.request contexts) -> output
    │                      processor -> response builder -> Transport
    ├── watch_disconnect   hypercorn does not cancel the app when the client goes, and a
    │                      send to a closed connection does not raise: wait for
    │                      http.disconnect instead
    └── watch_writes       a client that stops reading blocks our send (on trio hypercorn
                           shields it): abort the engine side after ``write_timeout``

Whichever ends first cancels the others; leaving a ``request`` context aborts its engine
request, so a disconnect at any point leaks nothing. Errors become the response right
where they are caught (``Transport.error``: a status before the response began, an
error event after), so nothing is carried out of the group.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import msgspec

from structllm.client import (
    EngineClient,
    EngineDeadError,
    EngineRequestError,
    RequestStream,
    Wakeup,
)
from structllm.ipc.ring import FrameTooLarge
from structllm.output import SequenceState, SequenceUpdate
from structllm.server.errors import APIError, overloaded
from structllm.server.metrics import Metrics
from structllm.server.responses import ResponseBuilder
from structllm.trace import OFF, Tracer

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = [(b"content-type", b"application/json")]
SSE = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class Admission:
    """The queue bounds of one front-end process: engine requests that have not yet had
    their first token, and their prompt tokens. ``admit`` refuses at once (503 with
    ``Retry-After``) past either bound; what it admits stays counted until the ticket
    releases it (first token or end) or the ``with`` block ends.

    A request counts only the queued requests of its own priority or a more urgent one
    (``ahead``): those are the ones the engine runs before or beside it. So a request
    more urgent than the whole queue enters even when less urgent ones fill it (they
    would wait behind it anyway), while the bound still holds among equals and for
    everything above any priority. Nobody already queued is turned away. Under fcfs
    every priority is 0: one plain bound."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.requests = 0
        self.tokens = 0
        self.by_priority: dict[int, list[int]] = {}  # priority -> [requests, tokens]

    def ahead(self, priority: int) -> tuple[int, int]:
        """Queued requests and their prompt tokens at ``priority`` or more urgent."""
        requests = tokens = 0
        for p, (n, t) in self.by_priority.items():
            if p <= priority:
                requests, tokens = requests + n, tokens + t
        return requests, tokens

    @contextmanager
    def admit(self, prompt_lens: list[int], priority: int = 0) -> Iterator[Ticket]:
        requests, tokens = self.ahead(priority)
        if (
            requests + len(prompt_lens) > self.max_requests
            or tokens + sum(prompt_lens) > self.max_tokens
        ):
            raise overloaded(requests, tokens)
        ticket = Ticket(self, prompt_lens, priority)
        try:
            yield ticket
        finally:
            for i in list(ticket.waiting):
                ticket.release(i)

    def count(self, priority: int, requests: int, tokens: int) -> None:
        """Add (or with negative counts take) queued requests at ``priority``."""
        self.requests += requests
        self.tokens += tokens
        row = self.by_priority.setdefault(priority, [0, 0])
        row[0] += requests
        row[1] += tokens
        if row[0] == 0:
            del self.by_priority[priority]


class Ticket:
    """The admitted sequences (by index) that are still counted as queued."""

    def __init__(self, admission: Admission, prompt_lens: list[int], priority: int = 0) -> None:
        self.admission = admission
        self.priority = priority
        self.waiting = dict(enumerate(prompt_lens))
        admission.count(priority, len(prompt_lens), sum(prompt_lens))

    def release(self, index: int) -> None:
        """Idempotent."""
        n = self.waiting.pop(index, None)
        if n is not None:
            self.admission.count(self.priority, -1, -n)


class Transport:
    """One response's side of the ASGI connection: JSON or server-sent events.
    ``sending_since`` is when the send in progress began (None when none is), for the
    write watchdog."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False
        self.sending_since: float | None = None

    async def write(self, message: Message) -> None:
        self.sending_since = time.monotonic()
        try:
            await self.send(message)
        finally:
            self.sending_since = None

    async def json(
        self, status: int, obj: Any, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        body = msgspec.json.encode(obj)
        self.started = True
        await self.write(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*JSON, (b"content-length", str(len(body)).encode()), *(headers or [])],
            }
        )
        await self.write({"type": "http.response.body", "body": body})

    async def start_events(self) -> None:
        self.started = True
        await self.write({"type": "http.response.start", "status": 200, "headers": SSE})

    async def event(self, obj: Any) -> None:
        await self.write(
            {
                "type": "http.response.body",
                "body": b"data: " + msgspec.json.encode(obj) + b"\n\n",
                "more_body": True,
            }
        )

    async def events(self, objs: list[Any]) -> None:
        """Several events, in order (a transport may write them at once)."""
        for obj in objs:
            await self.event(obj)

    async def end_events(self) -> None:
        await self.write(
            {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
        )

    async def error(self, err: APIError) -> None:
        """The error as OpenAI's JSON with its status, or, once the headers are out, as
        an error event followed by ``[DONE]``."""
        if not self.started:
            await self.json(err.status, err.body(), err.headers)
        else:
            await self.event(err.body())
            await self.end_events()


class Builder(Protocol):
    """What ``Generation`` needs of a response builder (``server.responses``'s, or the
    Responses API's): ``feed`` returns one chunk, a list of events, or None."""

    id: str
    stream: bool

    def opening(self) -> list[Any]: ...
    def feed(self, updates: list[SequenceUpdate]) -> Any: ...
    def closing(self) -> list[Any]: ...
    def body(self) -> Any: ...


@dataclass
class _Timing:
    start: float
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class Generation:
    """One response to produce: its sequences (from ``output.fan_out``) and builder."""

    client: EngineClient
    sequences: list[SequenceState]
    builder: ResponseBuilder | Builder
    metrics: Metrics
    tracer: Tracer = OFF
    # awaited once every sequence has finished, before the body or the closing events
    # go out (the Responses API stores the response there)
    before_end: Callable[[], Awaitable[None]] | None = None

    def trace_aborted(self, why: str) -> None:
        for seq in self.sequences:
            if not seq.finished:
                self.tracer.event("aborted", seq.request_id, why=why)

    async def run(
        self, receive: Receive, transport: Transport, ticket: Ticket, write_timeout: float
    ) -> None:
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.trace_aborted("the client disconnected")
                tg.cancel_scope.cancel()  # the client is gone: stop writing, abort the requests

            async def watch_writes() -> None:
                while True:
                    await anyio.sleep(min(1.0, write_timeout / 4))
                    since = transport.sending_since
                    if since is not None and time.monotonic() - since > write_timeout:
                        self.trace_aborted("the client stopped reading")
                        for seq in self.sequences:
                            self.client.finish_early(seq.request_id)
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            tg.start_soon(watch_writes)
            try:
                await self.respond(transport, ticket)
            except EngineRequestError as e:
                await transport.error(APIError(400, str(e)))
            except EngineDeadError as e:
                await transport.error(
                    APIError(
                        503,
                        f"the engine failed while serving this request: {e}",
                        type="service_unavailable",
                    )
                )
            except FrameTooLarge as e:
                await transport.error(
                    APIError(413, f"the request is too large for the engine channel: {e}")
                )
            except APIError as e:  # from before_end (the response store: 503)
                await transport.error(e)
            finally:
                self.metrics.set_open_requests(self.client.num_open_requests)
            tg.cancel_scope.cancel()

    async def respond(self, transport: Transport, ticket: Ticket) -> None:
        builder = self.builder
        start = time.monotonic()
        async with AsyncExitStack() as stack:
            wakeup = Wakeup()  # one for all sequences: the pump waits on them together
            streams = []
            for seq in self.sequences:
                self.tracer.event(
                    "sent", seq.request_id, response_id=builder.id
                )  # before the engine can see it
                streams.append(
                    await stack.enter_async_context(
                        self.client.request(
                            seq.request_id,
                            seq.prompt_ids,
                            seq.sampling,
                            wakeup,
                            seq.images,
                            seq.priority,
                            seq.lora,
                        )
                    )
                )
            self.metrics.set_open_requests(self.client.num_open_requests)
            if builder.stream:
                await transport.start_events()
                await transport.events(builder.opening())
            await self.pump(streams, wakeup, transport, ticket, start)
        if self.before_end is not None:
            await self.before_end()
        if builder.stream:
            await transport.events(builder.closing())
            await transport.end_events()
        else:
            await transport.json(200, builder.body())
            for seq in self.sequences:
                self.tracer.event("streamed", seq.request_id, body=True)

    async def pump(
        self,
        streams: list[RequestStream],
        wakeup: Wakeup,
        transport: Transport,
        ticket: Ticket,
        start: float,
    ) -> None:
        """Until every sequence has finished: take what arrived, run it through the
        output processor, and write what the builder makes of it."""
        timing = [_Timing(start) for _ in streams]
        live = list(zip(self.sequences, streams, strict=True))
        while live:
            await wakeup.wait()
            updates: list[SequenceUpdate] = []
            for seq, stream in list(live):
                d = stream.take()
                if d is None:
                    continue
                if d.token_ids or d.finish_reason is not None:
                    ticket.release(seq.index)
                self.observe(timing[seq.index], len(d.token_ids))
                update = seq.process(
                    d.token_ids,
                    d.logprobs,
                    d.finish_reason,
                    d.stop_reason,
                    d.num_cached_tokens,
                    d.prompt_logprobs,
                )
                if update.abort:
                    self.client.finish_early(seq.request_id)
                    self.tracer.event("aborted", seq.request_id, why="a stop string ended it")
                if self.tracer.enabled and update.text:
                    self.tracer.event("detokenized", seq.request_id, chars=len(update.text))
                if seq.finished:
                    self.tracer.event("finished", seq.request_id, reason=seq.finish_reason)
                    live.remove((seq, stream))
                    assert seq.finish_reason is not None
                    self.metrics.finished(
                        seq.finish_reason,
                        len(seq.prompt_ids),
                        len(seq.token_ids),
                        time.monotonic() - timing[seq.index].start,
                    )
                updates.append(update)
            chunk = self.builder.feed(updates)
            await transport.events(
                chunk if isinstance(chunk, list) else [] if chunk is None else [chunk]
            )
            if chunk and self.tracer.enabled:
                for u in updates:
                    self.tracer.event("streamed", self.sequences[u.index].request_id)

    def observe(self, t: _Timing, new_tokens: int) -> None:
        if not new_tokens:
            return
        now = time.monotonic()
        if t.first_token is None:
            t.first_token = now
            self.metrics.ttft.observe(now - t.start)
        elif t.last_token is not None:
            self.metrics.itl.observe((now - t.last_token) / new_tokens)
        t.last_token = now
