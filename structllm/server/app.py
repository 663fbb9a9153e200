"""The ASGI application: routing, auth, the OpenAI endpoints, SSE streaming.

Every generation request runs in its own task group: the response writer, and a task
blocked on ``receive()`` for ``http.disconnect`` (hypercorn does not cancel the app when
a client goes, and ``send`` to a closed connection does not raise). Whichever ends first
cancels the other. The writer holds its engine requests in ``EngineClient.request``
contexts, so cancellation (client gone, server shutting down) aborts them in the engine.
"""

from __future__ import annotations

import gc
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from structllm import __version__
from structllm.client import (
    EngineClient,
    EngineDeadError,
    EngineRequestError,
    RequestStream,
    Wakeup,
)
from structllm.ipc.ring import FrameTooLarge
from structllm.protocol import SamplingParams, TokenLogprobs
from structllm.server import openai as oa
from structllm.server.metrics import Metrics
from structllm.tokenizer import ChatTemplateError, Detokenizer, Tokenizer

log = logging.getLogger("structllm.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


@dataclass
class Settings:
    """Front-end limits. Requests waiting for their first token count as queued: past
    ``max_queued_requests`` or ``max_queued_tokens`` (prompt tokens) new generation
    requests get 503 with ``Retry-After`` at once. ``write_timeout``: a client that does
    not take a chunk for that long has its engine requests aborted."""

    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 16 << 20
    body_timeout: float = 30.0
    max_queued_requests: int = 512
    max_queued_tokens: int = 1 << 20
    write_timeout: float = 60.0
    allowed_origins: tuple[str, ...] = ()
    max_model_len: int = 0  # filled from the engine's handshake


@dataclass
class Choice:
    """One engine request of a response (one of ``n`` per prompt)."""

    index: int
    request_id: str
    prompt_len: int
    stream: RequestStream
    detok: Detokenizer
    start: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # kept for non-streamed responses
    pieces: list[str] = field(default_factory=list)  # kept for non-streamed responses
    streamed_chars: int = 0  # text sent so far in a stream (echoed prompt included)
    echoed: bool = False  # the prompt has gone out (streamed completions with echo)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None


class App:
    def __init__(self, settings: Settings, tokenizer: Tokenizer, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.client: EngineClient | None = None
        self.metrics = metrics or Metrics(settings.served_model_name)
        self.inflight = 0  # HTTP requests being handled
        self._drained: anyio.Event | None = None
        self._idle = anyio.Event()
        self.queued_requests = 0  # engine requests without their first token yet
        self.queued_tokens = 0  # their prompt tokens
        self.created = oa.now()
        self.routes: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            ("GET", "/health"): self.health,
            ("GET", "/version"): self.version,
            ("GET", "/v1/models"): self.models,
            ("GET", "/metrics"): self.metrics_endpoint,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize,
            ("GET", "/openapi.json"): self.openapi,
        }

    # -- ASGI --------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        self.inflight += 1
        try:
            await self._handle(scope, receive, send)
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()
                if self._drained is not None:
                    self._drained.set()

    async def collect_garbage_when_idle(self, min_interval: float = 2.0) -> None:
        """Run the cyclic garbage collector when the server goes idle (at most every
        ``min_interval`` s). Cancellations and disconnects leave reference cycles
        (exceptions, tracebacks, frames) that Python's generational collector may not
        reach for a long time; collecting in idle moments keeps the front end's memory
        at its working size under churn, at no cost to requests in flight."""
        while True:
            await self._idle.wait()
            self._idle = anyio.Event()
            await anyio.sleep(0.2)
            if self.inflight == 0:
                gc.collect()
            await anyio.sleep(min_interval)

    async def drained(self) -> None:
        """Return once no HTTP request is being handled."""
        if self.inflight:
            self._drained = anyio.Event()
            await self._drained.wait()

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"].rstrip("/") or "/"
        handler = self.routes.get((scope["method"], path))
        cors = self.cors_headers(scope)
        if cors is not None:
            send = _with_headers(send, cors)
            if scope["method"] == "OPTIONS":  # preflight
                await send({"type": "http.response.start", "status": 204, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
        try:
            if handler is None:
                if any(p == path for _, p in self.routes):
                    raise oa.APIError(405, f"method {scope['method']} is not allowed on {path}")
                raise oa.APIError(404, f"no route for {path}", code="not_found")
            if path not in ("/health", "/openapi.json"):
                self.authorize(scope)
            await handler(scope, receive, send)
        except oa.APIError as e:
            self.metrics.http_errors[e.status] = self.metrics.http_errors.get(e.status, 0) + 1
            await send_json(send, e.status, e.body(), e.headers)
        except ResponseStarted:
            pass
        except Exception:
            # A bug, not bad input; answer 500 (if the response has not begun) and keep serving.
            log.exception("error in %s %s", scope["method"], path)
            err = oa.APIError(500, "internal error", type="internal_server_error")
            with anyio.move_on_after(1):
                with suppress(Exception):
                    await send_json(send, 500, err.body())

    def cors_headers(self, scope: Scope) -> list[tuple[bytes, bytes]] | None:
        """CORS is off unless origins were allowed (``--allowed-origins``)."""
        origins = self.settings.allowed_origins
        if not origins:
            return None
        origin = dict(scope["headers"]).get(b"origin")
        if origin is None or ("*" not in origins and origin.decode("latin-1") not in origins):
            return None
        return [
            (b"access-control-allow-origin", origin),
            (b"vary", b"origin"),
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", b"authorization, content-type"),
        ]

    def authorize(self, scope: Scope) -> None:
        key = self.settings.api_key
        if key is None:
            return
        auth = dict(scope["headers"]).get(b"authorization", b"")
        token = auth[7:] if auth[:7].lower() == b"bearer " else b""
        if not hmac.compare_digest(token, key.encode()):
            raise oa.APIError(401, "missing or incorrect API key", type="authentication_error", code="invalid_api_key")

    def engine(self) -> EngineClient:
        if self.client is None:
            raise oa.APIError(503, "the engine is starting", type="service_unavailable")
        if self.client.dead is not None:
            raise oa.APIError(503, f"the engine is not available: {self.client.dead}", type="service_unavailable")
        return self.client

    # -- small endpoints ---------------------------------------------------------------

    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.engine()
        await send_json(send, 200, {"status": "ok"})

    async def openapi(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, oa.openapi_document(__version__))

    async def version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"version": __version__})

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        card = {
            "id": self.settings.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "structllm",
            "max_model_len": self.settings.max_model_len,
        }
        await send_json(send, 200, {"object": "list", "data": [card]})

    async def metrics_endpoint(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = self.client
        healthy = client is not None and client.dead is None
        stats = (await client.fresh_stats(0.5)) if client is not None and healthy else (client.stats if client else None)
        from structllm.protocol import EngineStats

        text = self.metrics.render(stats or EngineStats(), healthy)
        body = text.encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = oa.decode_body(await self.read_body(receive), oa.TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise oa.APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            fake = oa.ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
            ids = self.render_chat(fake)
        else:
            assert req.prompt is not None
            ids = self.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        await send_json(send, 200, {"tokens": ids, "count": len(ids), "max_model_len": self.settings.max_model_len})

    async def detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = oa.decode_body(await self.read_body(receive), oa.DetokenizeRequest)
        self.check_model(req.model)
        self.check_ids(req.tokens, "tokens")
        await send_json(send, 200, {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    # -- request preparation -----------------------------------------------------------

    async def read_body(self, receive: Receive) -> bytes:
        """The whole body, within ``max_body_bytes`` (else 413) and ``body_timeout``
        (else 408: a client that sends slowly does not hold a request forever)."""
        with anyio.move_on_after(self.settings.body_timeout) as scope:
            return await self._read_body(receive)
        assert scope.cancelled_caught
        raise oa.APIError(408, f"the request body did not arrive within {self.settings.body_timeout:.0f}s")

    async def _read_body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ResponseStarted  # nobody to answer
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.settings.max_body_bytes:
                raise oa.APIError(413, f"request body exceeds {self.settings.max_body_bytes} bytes")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise oa.APIError(404, f"the model `{model}` does not exist; this server serves `{self.settings.served_model_name}`",
                              param="model", code="model_not_found")

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size if self.client is None else self.client.ready.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise oa.APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    def render_chat(self, req: oa.ChatCompletionRequest) -> list[int]:
        messages = oa.chat_messages(req)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except ChatTemplateError as e:
            raise oa.APIError(400, str(e), param="messages") from None
        return self.encode(text, add_special_tokens=False, param="messages")

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # e.g. lone surrogates from JSON escapes
            raise oa.APIError(400, f"the text cannot be tokenized: {e}", param=param) from None

    def budget(self, prompt_lens: list[int], requested: int | None, param: str) -> int:
        """max_tokens for these prompts: the request's, or what the context leaves."""
        limit = self.settings.max_model_len
        longest = max(prompt_lens)
        if longest >= limit:
            raise oa.APIError(400, f"this model's maximum context length is {limit} tokens, but the prompt has {longest} tokens",
                              param="messages" if param == "max_completion_tokens" else "prompt", code="context_length_exceeded")
        if requested is None:
            return limit - longest
        if longest + requested > limit:
            raise oa.APIError(400, f"this model's maximum context length is {limit} tokens, but you requested "
                              f"{longest + requested} tokens ({longest} in the prompt, {requested} to generate)",
                              param=param, code="context_length_exceeded")
        return requested

    # -- generation --------------------------------------------------------------------

    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = oa.decode_body(await self.read_body(receive), oa.ChatCompletionRequest)
        self.check_model(req.model)
        client = self.engine()
        ids = self.render_chat(req)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.budget([len(ids)], requested, "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
        sp = oa.sampling_params(req, max_tokens, client.ready.vocab_size)
        await self.generate(scope, receive, send, client, "chat", req, [ids], sp)

    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = oa.decode_body(await self.read_body(receive), oa.CompletionRequest)
        self.check_model(req.model)
        client = self.engine()
        if req.suffix:
            raise oa.APIError(400, "suffix is not supported", param="suffix")
        if req.echo and req.logprobs is not None:
            raise oa.APIError(400, "echo together with logprobs is not supported (no prompt logprobs)", param="echo")
        prompts = self.completion_prompts(req.prompt)
        if len(prompts) * req.n > oa.MAX_SEQUENCES:
            raise oa.APIError(400, f"{len(prompts)} prompts x n={req.n} exceeds {oa.MAX_SEQUENCES} sequences per request", param="prompt")
        max_tokens = self.budget([len(p) for p in prompts], req.max_tokens, "max_tokens")
        sp = oa.sampling_params(req, max_tokens, client.ready.vocab_size)
        await self.generate(scope, receive, send, client, "text", req, prompts, sp)

    def completion_prompts(self, prompt: str | list[str | int | list[int]]) -> list[list[int]]:
        items: list[Any]
        if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
            items = [prompt]
        elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            items = list(prompt)
        else:
            raise oa.APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                              "token-id lists", param="prompt")
        if not items:
            raise oa.APIError(400, "prompt must not be empty", param="prompt")
        out = []
        for p in items:
            ids = self.encode(p) if isinstance(p, str) else list(p)
            if not ids:
                raise oa.APIError(400, "prompt must not be empty", param="prompt")
            self.check_ids(ids, "prompt")
            out.append(ids)
        return out

    async def generate(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        client: EngineClient,
        kind: str,
        req: oa.ChatCompletionRequest | oa.CompletionRequest,
        prompts: list[list[int]],
        sp: SamplingParams,
    ) -> None:
        """Run the response in a task group beside the disconnect watcher and the write
        watchdog. Errors that become a status are carried out of the group."""
        self.admit(len(prompts) * req.n, sum(len(p) for p in prompts) * req.n)
        writer = Writer(self, client, kind, req, prompts, sp, send)
        error: oa.APIError | None = None
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()  # the client is gone: stop writing, abort the requests

            async def watch_writes() -> None:
                # A client that stops reading blocks our send (on trio hypercorn shields
                # it, so cancellation cannot interrupt it): abort the engine side anyway.
                while True:
                    await anyio.sleep(min(1.0, self.settings.write_timeout / 4))
                    since = writer.sending_since
                    if since is not None and time.monotonic() - since > self.settings.write_timeout:
                        writer.abort_all()
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            tg.start_soon(watch_writes)
            try:
                await writer.run()
            except oa.APIError as e:
                error = e
            tg.cancel_scope.cancel()
        if error is not None:
            raise error

    def admit(self, sequences: int, prompt_tokens: int) -> None:
        """Refuse at once (503 + Retry-After) when the queue bounds would be exceeded."""
        s = self.settings
        if self.queued_requests + sequences > s.max_queued_requests or self.queued_tokens + prompt_tokens > s.max_queued_tokens:
            raise oa.APIError(
                503,
                f"the server is overloaded ({self.queued_requests} requests with {self.queued_tokens} prompt tokens "
                f"are queued); retry later",
                type="service_unavailable",
                code="overloaded",
                headers=[(b"retry-after", b"1")],
            )


class ResponseStarted(Exception):
    """The response has begun (or the client is gone): errors cannot become a status."""


class Writer:
    """Produces one response: drives its engine requests and writes JSON or SSE."""

    def __init__(self, app: App, client: EngineClient, kind: str, req: Any, prompts: list[list[int]],
                 sp: SamplingParams, send: Send) -> None:
        self.app, self.client, self.kind, self.req, self.prompts, self.sp, self.send = app, client, kind, req, prompts, sp, send
        self.n = req.n
        self.stream = req.stream
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = oa.now()
        self.model = app.settings.served_model_name
        self.started = False
        self.want_logprobs = sp.logprobs is not None
        self.sending_since: float | None = None
        self.choices: list[Choice] = []
        self._queued: set[str] = set()  # our requests still counted in app.queued_*

    def _unqueue(self, c: Choice) -> None:
        if c.request_id in self._queued:
            self._queued.discard(c.request_id)
            self.app.queued_requests -= 1
            self.app.queued_tokens -= c.prompt_len

    def abort_all(self) -> None:
        for c in self.choices:
            self.client.finish_early(c.request_id)

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            for c in self.choices:
                self._unqueue(c)
            self.app.metrics.set_open_requests(self.client.num_open_requests)

    async def _run(self) -> None:
        tok = self.app.tokenizer
        wakeup = Wakeup()
        choices = self.choices
        try:
            async with AsyncExitStack() as stack:
                for pi, ids in enumerate(self.prompts):
                    for j in range(self.n):
                        sp = self.sp
                        if self.n > 1 and sp.seed is not None:
                            sp = msgspec.structs.replace(sp, seed=sp.seed + j)
                        rid = self.client.new_request_id(self.kind)
                        stream = await stack.enter_async_context(self.client.request(rid, ids, sp, wakeup))
                        detok = Detokenizer(tok, sp.stop, sp.include_stop_str_in_output, sp.skip_special_tokens)
                        choices.append(Choice(pi * self.n + j, rid, len(ids), stream, detok, time.monotonic()))
                        self._queued.add(rid)
                        self.app.queued_requests += 1
                        self.app.queued_tokens += len(ids)
                self.app.metrics.set_open_requests(self.client.num_open_requests)
                if self.stream:
                    await self.start_stream()
                    if self.kind == "chat":
                        await self.sse([self.chunk_choice(c, {"role": "assistant", "content": ""}, None, None) for c in choices])
                await self.pump(choices, wakeup)
        except EngineRequestError as e:
            await self.fail(oa.APIError(400, str(e)))
            return
        except EngineDeadError as e:
            await self.fail(oa.APIError(503, f"the engine failed while serving this request: {e}", type="service_unavailable"))
            return
        except FrameTooLarge as e:
            await self.fail(oa.APIError(413, f"the request is too large for the engine channel: {e}"))
            return
        if self.stream:
            if self.include_usage:
                await self.sse([], usage=self.usage(choices))
            await self.write({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        else:
            await send_json(self.write, 200, self.full_response(choices))

    async def pump(self, choices: list[Choice], wakeup: Wakeup) -> None:
        live = list(choices)
        while live:
            await wakeup.wait()
            updates = []
            for c in list(live):
                d = c.stream.take()
                if d is None:
                    continue
                now = time.monotonic()
                if d.token_ids or d.finish_reason is not None:
                    self._unqueue(c)
                if d.token_ids:
                    if c.first_token_at is None:
                        c.first_token_at = now
                        self.app.metrics.ttft.observe(now - c.start)
                    elif c.last_token_at is not None:
                        self.app.metrics.itl.observe((now - c.last_token_at) / len(d.token_ids))
                    c.last_token_at = now
                c.num_cached = d.num_cached_tokens
                text, stopped = c.detok.add(d.token_ids)
                new_tokens = d.token_ids
                new_lps = d.logprobs
                if stopped:
                    self.client.finish_early(c.request_id)
                    c.finish_reason, c.stop_reason = "stop", c.detok.stop_str
                elif d.finish_reason is not None:
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
                if c.finish_reason is not None:
                    text += c.detok.finish()
                    live.remove(c)
                    self.app.metrics.finished(c.finish_reason, c.prompt_len, len(c.tokens) + len(new_tokens), now - c.start)
                c.tokens += new_tokens
                if not self.stream:
                    c.logprobs += new_lps
                    c.pieces.append(text)
                elif text or c.finish_reason or new_lps:
                    updates.append(self.stream_update(c, text, new_tokens, new_lps))
            if updates:
                await self.sse(updates)

    # -- output shapes ---------------------------------------------------------------

    def usage(self, choices: list[Choice]) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.prompts)
        cached = sum(c.num_cached for c in choices if c.index % self.n == 0)
        return oa.usage(prompt, sum(len(c.tokens) for c in choices), cached)

    def chat_logprobs(self, tokens: list[int], lps: list[TokenLogprobs]) -> dict[str, Any]:
        tok = self.app.tokenizer

        def entry(t: int, lp: float) -> dict[str, Any]:
            b = tok.token_bytes(t)
            return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

        content = []
        for t, lp in zip(tokens, lps, strict=False):
            e = entry(t, lp.logprob)
            e["top_logprobs"] = [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
            content.append(e)
        return {"content": content}

    def text_logprobs(self, tokens: list[int], lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        tok = self.app.tokenizer
        texts = [tok.token_text(t) for t in tokens]
        offsets = []
        for t in texts:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": texts,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{tok.token_text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)} for lp in lps],
            "text_offset": offsets,
        }

    def full_response(self, choices: list[Choice]) -> dict[str, Any]:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            text = "".join(c.pieces)
            if self.kind == "chat":
                item: dict[str, Any] = {
                    "index": c.index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": self.chat_logprobs(c.tokens, c.logprobs) if self.want_logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                if c.stop_reason is not None:
                    item["stop_reason"] = c.stop_reason
            else:
                prefix = self.app.tokenizer.decode(self.prompts[c.index // self.n]) if self.req.echo else ""
                item = {
                    "index": c.index,
                    "text": prefix + text,
                    "logprobs": self.text_logprobs(c.tokens, c.logprobs, len(prefix)) if self.want_logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                if c.stop_reason is not None:
                    item["stop_reason"] = c.stop_reason
            out.append(item)
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": out,
            "usage": self.usage(choices),
        }

    def chunk_choice(self, c: Choice, delta: dict[str, Any] | None, text: str | None, logprobs: Any) -> dict[str, Any]:
        if self.kind == "chat":
            return {"index": c.index, "delta": delta or {}, "logprobs": logprobs, "finish_reason": c.finish_reason}
        return {"index": c.index, "text": text or "", "logprobs": logprobs, "finish_reason": c.finish_reason}

    def stream_update(self, c: Choice, text: str, tokens: list[int], lps: list[TokenLogprobs]) -> dict[str, Any]:
        if self.kind == "chat":
            lp = self.chat_logprobs(tokens, lps) if self.want_logprobs and lps else None
            return self.chunk_choice(c, {"content": text} if text else {}, None, lp)
        # the first chunk sent carries the prompt (the first delta may have been held
        # back whole by the detokenizer, so it is not "the first delta")
        prefix = ""
        if self.req.echo and not c.echoed:
            prefix, c.echoed = self.app.tokenizer.decode(self.prompts[c.index // self.n]), True
        offset = c.streamed_chars + len(prefix)
        c.streamed_chars = offset + len(text)
        lp = self.text_logprobs(tokens, lps, offset) if self.want_logprobs and lps else None
        return self.chunk_choice(c, None, prefix + text, lp)

    # -- transport -------------------------------------------------------------------

    async def write(self, message: Message) -> None:
        self.sending_since = time.monotonic()
        try:
            await self.send(message)
        finally:
            self.sending_since = None

    async def start_stream(self) -> None:
        await self.write({"type": "http.response.start", "status": 200, "headers": SSE})
        self.started = True

    async def sse(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = usage
        await self.write({"type": "http.response.body", "body": b"data: " + msgspec.json.encode(chunk) + b"\n\n", "more_body": True})

    async def fail(self, err: oa.APIError) -> None:
        if not self.started:
            raise err
        # Headers are out: report in the stream, then end it (through write, so the
        # watchdog also covers a client that stopped reading)
        await self.write({"type": "http.response.body", "body": b"data: " + msgspec.json.encode(err.body()) + b"\n\n", "more_body": True})
        await self.write({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def send_json(send: Send, status: int, obj: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = msgspec.json.encode(obj)
    await send({"type": "http.response.start", "status": status,
                "headers": [*JSON, (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
