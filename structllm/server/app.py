"""The ASGI layer: routes, auth, CORS, request bodies, error JSON, idle-time GC.

A generation request goes: ``read_body`` -> ``requests.decode_body`` (types) ->
``Preprocessor`` in a worker thread (chat template, tokenization, prompt checks) ->
``requests.sampling_params`` (sampling rules) -> ``output.fan_out`` (one engine request
per prompt and choice) -> ``Admission.admit`` (queue bounds) -> ``Generation.run``
(engine requests, output processor, response builder, transport; see
``server.generation``). An ``APIError`` raised before the response begins becomes
OpenAI's error JSON here.
"""

from __future__ import annotations

import gc
import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar, TypeVarTuple

import anyio

from structllm import __version__
from structllm.client import EngineClient
from structllm.multimodal.processor import ImageProcessor
from structllm.output import SequenceState
from structllm.protocol import EngineStats, LoraRef, StructuredOutputs
from structllm.server import body, completions_endpoint, embeddings, scores
from structllm.server import requests as rq
from structllm.server.body import TrackedReceive
from structllm.server.config import ServerConfig
from structllm.server.errors import APIError, ClientGone
from structllm.server.generation import Admission, Builder, Generation, Transport
from structllm.server.lora import (
    LoadLoraAdapterRequest,
    ServedAdapters,
    UnloadLoraAdapterRequest,
    runtime_updates_allowed,
)
from structllm.server.metrics import Metrics
from structllm.server.openapi import openapi_document
from structllm.server.pipeline import Message, Receive, Scope, Send
from structllm.server.preprocess import Preprocessor
from structllm.server.probes import RouterProbes
from structllm.server.responses import ResponseBuilder
from structllm.server.responses_endpoint import ResponsesEndpoints
from structllm.server.vision import Vision
from structllm.server.webui import StaticFile, load_files
from structllm.tokenizer import Tokenizer
from structllm.tools import Format, ToolRequest, format_named
from structllm.trace import Tracer

log = logging.getLogger("structllm.server")

Ts = TypeVarTuple("Ts")
R = TypeVar("R")
TOKENIZER_THREADS = 2  # concurrent chat-template renders and tokenizations per process


class App:
    """The ASGI application of one front-end process, serving ``model_name``."""

    def __init__(
        self,
        config: ServerConfig,
        model_name: str,
        tokenizer: Tokenizer,
        metrics: Metrics | None = None,
        sampling_defaults: dict[str, float | int] | None = None,
        image_processor: ImageProcessor | None = None,
        adapters: ServedAdapters | None = None,
    ) -> None:
        self.config = config
        self.adapters = adapters  # LoRA adapters served by name (None: none can be)
        # where a request leaves a sampling parameter unset (files.generation_defaults)
        self.sampling_defaults = sampling_defaults or {}
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.client: EngineClient | None = None
        self.metrics = metrics or Metrics(model_name)
        if adapters is not None and adapters.enabled:
            self.metrics.max_loras = config.engine.max_loras
        self.inflight = 0  # HTTP requests being handled
        self._drained: anyio.Event | None = None
        self._idle = anyio.Event()
        self.admission = Admission(config.max_queued_requests, config.max_queued_tokens)
        self.tracer = Tracer(config.engine.trace, f"structllm front end {os.getpid()}")
        self.tool_format: Format | None = format_named(config.tool_call_parser)
        self.vision = Vision(model_name, image_processor, config)  # image parts: checks, fetches
        self.pre = self.preprocessor(None, tokenizer.vocab_size)  # until an engine is attached
        self._pool: anyio.CapacityLimiter | None = None  # made in the event loop, on first use
        self.created = int(time.time())
        self.responses = ResponsesEndpoints(self)  # /v1/responses and its store
        probes = RouterProbes(config, model_name, self.engine, lambda: self.draining)
        self.routes: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            ("GET", "/health"): self.health,
            ("GET", "/version"): self.version,
            ("GET", "/v1/models"): self.models,
            ("GET", "/metrics"): self.metrics_endpoint,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/responses"): self.responses.create,
            ("POST", "/v1/embeddings"): self.embeddings,
            ("POST", "/score"): self.score,
            ("POST", "/v1/score"): self.score,
            ("POST", "/rerank"): self.rerank,
            ("POST", "/v1/rerank"): self.rerank,
            ("POST", "/v2/rerank"): self.rerank,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize,
            ("GET", "/openapi.json"): self.openapi,
            # what routers in front of replicas probe (vllm-router, sglang-router)
            ("GET", "/health_generate"): probes.health_generate,
            ("GET", "/get_load"): probes.get_load,
            ("GET", "/get_model_info"): probes.get_model_info,
            ("GET", "/get_server_info"): probes.get_server_info,
        }
        if adapters is not None and adapters.enabled and runtime_updates_allowed():
            self.routes["POST", "/v1/load_lora_adapter"] = self.load_lora_adapter
            self.routes["POST", "/v1/unload_lora_adapter"] = self.unload_lora_adapter
        # the chat page (server/webui.py): public files, served from memory
        self.static: dict[str, StaticFile] = load_files() if config.web_ui else {}
        for route in self.static:
            self.routes["GET", route] = self.static_file
        # Set on SIGTERM: /health answers 503 so a router stops sending new requests
        # here, while the requests in flight (and any that still arrive) are served.
        self.draining = False

    # -- ASGI --------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        with self.busy():
            await self._handle(scope, receive, send)

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Count work in flight (an HTTP request, a background response) for ``drained``."""
        self.inflight += 1
        try:
            yield
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
        # an answer before the body was read: read it first, to keep the connection usable
        tracked = TrackedReceive(receive)
        await self._route(scope, tracked, tracked.sender(send))

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"].rstrip("/") or "/"
        handler = self.routes.get((scope["method"], path))
        if handler is None and scope["method"] == "GET" and path.startswith("/v1/models/"):
            handler = self.model  # GET /v1/models/{model}: the id may itself hold slashes
        route_error = None
        if handler is None and path.startswith("/v1/responses/"):
            try:
                handler = self.responses.route(scope["method"], path)
            except APIError as e:
                route_error = e
        cors = self.cors_headers(scope)
        if cors is not None:
            send = _with_headers(send, cors)
            if scope["method"] == "OPTIONS":  # preflight
                await send({"type": "http.response.start", "status": 204, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
        try:
            if handler is None:
                if route_error is not None:
                    raise route_error
                if any(p == path for _, p in self.routes):
                    raise APIError(405, f"method {scope['method']} is not allowed on {path}")
                raise APIError(404, f"no route for {path}", code="not_found")
            # open: the health check, and the load a router reads (vllm-router asks
            # /get_load without the --api-key it sends with forwarded requests)
            if path not in ("/health", "/get_load", "/openapi.json") and path not in self.static:
                self.authorize(scope)
            await handler(scope, receive, send)
        except APIError as e:
            self.metrics.http_errors[e.status] = self.metrics.http_errors.get(e.status, 0) + 1
            await send_json(send, e.status, e.body(), e.headers)
        except ClientGone:
            pass
        except Exception:
            # A bug, not bad input; answer 500 (if the response has not begun) and keep serving.
            log.exception("error in %s %s", scope["method"], path)
            err = APIError(500, "internal error", type="internal_server_error")
            with anyio.move_on_after(1), suppress(Exception):
                await send_json(send, 500, err.body())

    def cors_headers(self, scope: Scope) -> list[tuple[bytes, bytes]] | None:
        """CORS is off unless origins were allowed (``--allowed-origins``)."""
        origins = self.config.allowed_origins
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
        key = self.config.api_key
        if key is None:
            return
        auth = dict(scope["headers"]).get(b"authorization", b"")
        token = auth[7:] if auth[:7].lower() == b"bearer " else b""
        if not hmac.compare_digest(token, key.encode()):
            raise APIError(
                401,
                "missing or incorrect API key",
                type="authentication_error",
                code="invalid_api_key",
            )

    def close(self) -> None:
        """Release what the app holds beyond its requests (the trace file). Idempotent."""
        self.tracer.close()
        self.responses.close()

    def attach(self, client: EngineClient) -> None:
        """Serve generation requests through ``client`` (an engine that is ready)."""
        self.pre = self.preprocessor(client.ready.max_model_len, client.ready.vocab_size)
        self.client = client

    def preprocessor(self, max_model_len: int | None, vocab_size: int) -> Preprocessor:
        return Preprocessor(
            self.tokenizer,
            max_model_len,
            vocab_size,
            self.tool_format,
            self.tracer,
            self.config.reasoning_parser,
            self.vision.processor,
            self.config.max_image_pixels,
        )

    @property
    def harmony(self) -> bool:
        return self.pre.harmony

    def engine(self) -> EngineClient:
        if self.client is None:
            raise APIError(503, "the engine is starting", type="service_unavailable")
        if self.client.dead is not None:
            raise APIError(
                503, f"the engine is not available: {self.client.dead}", type="service_unavailable"
            )
        return self.client

    # -- small endpoints ---------------------------------------------------------------

    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.engine()
        if self.draining:
            raise APIError(503, "the server is stopping", type="service_unavailable")
        await send_json(send, 200, {"status": "ok"})

    async def static_file(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A file of the chat page; touches neither the engine nor the API's state."""
        f = self.static[scope["path"].rstrip("/") or "/"]
        await send({"type": "http.response.start", "status": 200, "headers": f.headers})
        await send({"type": "http.response.body", "body": f.body})

    async def openapi(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, openapi_document(__version__))

    async def version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"version": __version__})

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "structllm",
            "max_model_len": self.pre.max_model_len or 0,
            "input_modalities": self.vision.input_modalities,  # ["text", "image"] with images
        }

    def adapter_cards(self) -> list[dict[str, Any]]:
        return self.adapters.cards(self.created) if self.adapters is not None else []

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        cards = [self.model_card(), *self.adapter_cards()]
        await send_json(send, 200, {"object": "list", "data": cards})

    async def model(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = scope["path"].rstrip("/").removeprefix("/v1/models/")
        self.check_model(name)
        card = next((c for c in self.adapter_cards() if c["id"] == name), None)
        await send_json(send, 200, card or self.model_card())

    async def load_lora_adapter(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = rq.decode_body(await self.read_body(receive), LoadLoraAdapterRequest)
        assert self.adapters is not None  # (routed only with adapters)
        text = await self.in_worker(self.adapters.load, req)  # reads the adapter's files
        await send_text(send, 200, text)

    async def unload_lora_adapter(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = rq.decode_body(await self.read_body(receive), UnloadLoraAdapterRequest)
        assert self.adapters is not None
        await send_text(send, 200, self.adapters.unload(req))

    async def metrics_endpoint(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = self.client
        healthy = client is not None and client.dead is None
        stats = (
            (await client.fresh_stats(0.5))
            if client is not None and healthy
            else (client.stats if client else None)
        )
        text = self.metrics.render(stats or EngineStats(), healthy)
        body = text.encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = rq.decode_body(await self.read_body(receive), rq.TokenizeRequest)
        self.check_model(req.model)
        media = await self.vision.load(rq.image_urls(req.messages), "messages")
        ids = await self.in_worker(self.pre.tokenize, req, media)
        await send_json(
            send,
            200,
            {"tokens": ids, "count": len(ids), "max_model_len": self.pre.max_model_len or 0},
        )

    async def detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = rq.decode_body(await self.read_body(receive), rq.DetokenizeRequest)
        self.check_model(req.model)
        await send_json(
            send, 200, {"prompt": await self.in_worker(self.pre.detokenize, req.tokens)}
        )

    # -- pooling -----------------------------------------------------------------------

    async def embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        await embeddings.embeddings(self, scope, receive, send)

    async def score(self, scope: Scope, receive: Receive, send: Send) -> None:
        await scores.score(self, scope, receive, send)

    async def rerank(self, scope: Scope, receive: Receive, send: Send) -> None:
        await scores.rerank(self, scope, receive, send)

    @property
    def max_model_len(self) -> int | None:
        """The engine's context length (None until an engine is attached)."""
        return self.pre.max_model_len

    def generating_engine(self, api: str) -> EngineClient:
        """The engine, which must run the generate runner (400 on a pooling server, as
        vLLM answers an API its runner does not serve)."""
        client = self.engine()
        if client.ready.pooler is not None:
            raise APIError(400, f"The model does not support {api} API", param="model")
        return client

    # -- generation (server/completions_endpoint.py) -----------------------------------

    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await completions_endpoint.chat_completions(self, scope, receive, send)

    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await completions_endpoint.completions(self, scope, receive, send)

    async def chat_sequences(
        self, req: rq.ChatCompletionRequest, response_id: str, kind: str, client: EngineClient
    ) -> list[SequenceState]:
        return await completions_endpoint.chat_sequences(self, req, response_id, kind, client)

    async def generate(
        self,
        receive: Receive,
        send: Send,
        client: EngineClient,
        seqs: list[SequenceState],
        builder: ResponseBuilder | Builder,
        transport: Transport | None = None,
        before_end: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        priority = seqs[0].priority if seqs else 0  # one request's: the same for all
        with self.admission.admit([len(s.prompt_ids) for s in seqs], priority) as ticket:
            generation = Generation(client, seqs, builder, self.metrics, self.tracer, before_end)
            await generation.run(
                receive, transport or Transport(send), ticket, self.config.write_timeout
            )

    # -- request preparation -----------------------------------------------------------

    async def constraint(
        self, req: rq.ChatCompletionRequest | rq.CompletionRequest, tools: ToolRequest | None = None
    ) -> StructuredOutputs | None:
        """The request's output constraint, compiled once in the worker pool to check it."""
        if req.response_format is None and req.structured_outputs is None and tools is None:
            return None
        return await self.in_worker(self.pre.constraint, req, tools)

    async def in_worker(self, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        """``fn(*args)`` in the bounded tokenizer pool (CPU-bound work off the event loop)."""
        if self._pool is None:
            self._pool = anyio.CapacityLimiter(TOKENIZER_THREADS)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._pool)

    async def read_body(self, receive: Receive) -> bytes:
        """The whole body, within ``max_body_bytes`` (413) and ``body_timeout`` (408)."""
        return await body.read_body(receive, self.config.max_body_bytes, self.config.body_timeout)

    def check_model(self, model: str | None) -> LoraRef | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); 404
        ``model_not_found`` for a name this server does not serve."""
        if self.adapters is not None:
            return self.adapters.ref(model)
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )
        return None


async def send_text(send: Send, status: int, text: str) -> None:
    body = text.encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8")]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, obj: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await Transport(send).json(status, obj, headers)


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
