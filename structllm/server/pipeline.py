"""What the endpoints beyond ``app.py`` use of the app: the ASGI types and the
``ChatPipeline``, ``GenerationPipeline`` and ``PoolingPipeline`` interfaces (``App``
implements them), so that those modules need not import ``app.py`` (which imports
them)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, TypeVarTuple

from structllm.client import EngineClient
from structllm.output import SequenceState
from structllm.protocol import LoraRef, StructuredOutputs
from structllm.server.config import ServerConfig
from structllm.server.generation import Admission, Builder, Transport
from structllm.server.metrics import Metrics
from structllm.server.preprocess import Preprocessor
from structllm.server.requests import ChatCompletionRequest, CompletionRequest
from structllm.server.responses import ResponseBuilder
from structllm.server.vision import Vision
from structllm.tokenizer import Tokenizer
from structllm.tools import ToolRequest
from structllm.trace import Tracer

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Ts = TypeVarTuple("Ts")
R = TypeVar("R")


class GenerationPipeline(Protocol):
    """What ``server/completions_endpoint.py`` uses of the app: the request's body and
    model, its preparation (the preprocessor, image loading, the worker pool, the
    constraint), the engine and the generation itself."""

    config: ServerConfig
    tracer: Tracer
    model_name: str
    tokenizer: Tokenizer
    pre: Preprocessor
    vision: Vision
    sampling_defaults: dict[str, float | int]

    async def read_body(self, receive: Receive) -> bytes: ...

    def check_model(self, model: str | None) -> LoraRef | None: ...

    def generating_engine(self, api: str) -> EngineClient: ...

    async def in_worker(self, fn: Callable[[*Ts], R], *args: *Ts) -> R: ...

    async def constraint(
        self, req: ChatCompletionRequest | CompletionRequest, tools: ToolRequest | None = None
    ) -> StructuredOutputs | None: ...

    async def generate(
        self,
        receive: Receive,
        send: Send,
        client: EngineClient,
        seqs: list[SequenceState],
        builder: ResponseBuilder | Builder,
        transport: Transport | None = None,
        before_end: Callable[[], Awaitable[None]] | None = None,
    ) -> None: ...


class ChatPipeline(GenerationPipeline, Protocol):
    """A front end's chat path: the Responses endpoints prepare and generate through it
    (the generation path's interface, and what a background run needs besides)."""

    metrics: Metrics
    client: EngineClient | None

    @property
    def harmony(self) -> bool:
        """gpt-oss's harmony format: Responses reasoning items and effort reach the prompt."""
        ...

    def busy(self) -> AbstractContextManager[None]:
        """Count a background run as work in flight (a graceful stop drains it)."""
        ...

    def engine(self) -> EngineClient:
        """The engine client, or a 503 while there is none."""
        ...

    async def chat_sequences(
        self, req: ChatCompletionRequest, response_id: str, kind: str, client: EngineClient
    ) -> list[SequenceState]:
        """``req`` prepared as the chat endpoint does (images, template, tokens,
        constraint, sampling): its sequences, engine request ids named ``kind``."""
        ...


class PoolingPipeline(Protocol):
    """A front end's pooling path (``server/embeddings.py``): the body, the model's
    name and tokenizer, the engine, the worker pool and the queue bounds."""

    model_name: str
    tokenizer: Tokenizer
    admission: Admission

    @property
    def max_model_len(self) -> int | None: ...

    async def read_body(self, receive: Receive) -> bytes: ...

    def check_model(self, model: str | None) -> LoraRef | None: ...

    def engine(self) -> EngineClient: ...

    async def in_worker(self, fn: Callable[[*Ts], R], *args: *Ts) -> R: ...
