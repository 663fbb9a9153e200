"""OpenAI request bodies (validated by msgspec) and response shapes.

Bodies decode into frozen Structs; a decode or validation failure becomes an
``APIError`` (400) whose ``param`` names the offending field. Unknown fields are
ignored, as OpenAI's own server and vLLM do, so newer clients keep working.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from structllm.protocol import SamplingParams


class APIError(Exception):
    """An error answered with OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or []

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MAX_N = 64
MAX_STOP = 16
MAX_STOP_LEN = 1024
MAX_SEQUENCES = 256  # prompts x n in one request

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0)]


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """Fields shared by both endpoints (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stop: Annotated[str, Meta(max_length=MAX_STOP_LEN)] | Annotated[list[Annotated[str, Meta(max_length=MAX_STOP_LEN)]], Meta(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=1024)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class ChatCompletionRequest(_Sampling, frozen=True, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    # str, list[str], list[int] or list[list[int]] (msgspec unions allow one list type,
    # so the shape is checked by the app)
    prompt: str | list[str | int | list[int]]
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


_PATH = re.compile(r"at `\$\.?([^`]*)`")


def decode_body(body: bytes, kind: type[Any]) -> Any:
    """JSON bytes -> ``kind``; any failure is a 400 naming the field when possible."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        m = _PATH.search(str(e))
        param = m.group(1).split("[")[0].split(".")[0] if m else None
        raise APIError(400, f"invalid request: {e}", param=param or None) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid UTF-8: {e}") from None
    except RecursionError:
        raise APIError(400, "the body is nested too deeply") from None


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the chat template expects them; text parts are joined."""
    out = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant"):
            raise APIError(400, f"messages[{i}].role must be system, user or assistant, got {m.role!r}", param="messages")
        if isinstance(m.content, list):
            parts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}]: only text content parts are supported, got {part.type!r}", param="messages")
                parts.append(part.text)
            content = "".join(parts)
        else:
            content = m.content or ""
        out.append({"role": role, "content": content})
    return out


def sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int, vocab_size: int) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty", param="stop")
    bad = next((t for t in req.stop_token_ids or [] if t >= vocab_size), None)
    if bad is not None:
        raise APIError(400, f"stop_token_ids contains {bad}, outside the vocabulary [0, {vocab_size})", param="stop_token_ids")
    if req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    try:
        return SamplingParams(
            n=1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as e:
        field = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
        raise APIError(400, str(e), param=field) from None


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out



def openapi_document(version: str) -> dict[str, Any]:
    """OpenAPI 3.1 description of the server (request bodies from the Structs above)."""
    bodies = {
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/completions": CompletionRequest,
        "/tokenize": TokenizeRequest,
        "/detokenize": DetokenizeRequest,
    }
    schemas, components = msgspec.json.schema_components(list(bodies.values()), ref_template="#/components/schemas/{name}")
    error = {"description": "OpenAI error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    components["Error"] = {
        "type": "object",
        "properties": {"error": {"type": "object", "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
    }
    ok = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    paths: dict[str, Any] = {}
    for (path, _), schema in zip(bodies.items(), schemas, strict=True):
        paths[path] = {"post": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {"200": ok, "400": error, "401": error, "404": error, "413": error, "503": error},
        }}
    for path in ("/v1/models", "/health", "/version"):
        paths[path] = {"get": {"responses": {"200": ok, "503": error}}}
    paths["/metrics"] = {"get": {"responses": {"200": {"description": "Prometheus text", "content": {"text/plain": {}}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "structllm", "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
