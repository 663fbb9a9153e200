"""OpenAI request bodies and their validation, one place per rule.

Bodies decode into frozen Structs; a decode or type failure becomes an ``APIError``
(400) whose ``param`` names the offending field. Unknown fields are ignored, as OpenAI's
own server and vLLM do, so newer clients keep working. Who checks what:

- the Structs below: types, and the limits this server sets on top of the sampling
  rules (``n``, temperature up to 2, the size of stop lists and strings);
- ``SamplingParams.__post_init__``: every sampling rule (ranges, min_tokens vs
  max_tokens, empty stop strings), turned into a 400 naming the request's field by
  ``sampling_params``;
- ``check_token_ids``: prompt token ids against the vocabulary (``SamplingParams.check_vocab``
  the ids the sampling fields name);
- ``max_tokens_for``: the context length.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from structllm.protocol import Reasoning, SamplingParams, StructuredOutputs
from structllm.server.errors import APIError
from structllm.tokenizer import check_template_kwargs

MAX_N = 64
MAX_STOP = 16
MAX_STOP_LEN = 1024
MAX_SEQUENCES = 256  # prompts x n in one request

Temperature = Annotated[float, Meta(le=2.0)]
# vLLM's request priority (lower runs earlier): an int64, as vLLM's field
Priority = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (not only the last)
    continuous_usage_stats: bool = False


class ImageURL(msgspec.Struct, frozen=True):
    url: str
    detail: str | None = None  # auto, low or high: accepted; the model's processor sizes it


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None
    image_url: str | ImageURL | None = None  # some clients send the URL as a bare string


class FunctionCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(msgspec.Struct, frozen=True):
    """A call in an earlier assistant message of the conversation."""

    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning: str | None = None  # assistant: its reasoning, as vLLM takes it back
    reasoning_content: str | None = None  # (the name of the chat reply's field)


class _Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """Fields shared by both endpoints (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: Temperature | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0: off
    min_p: float | None = None
    seed: int | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stop: (
        Annotated[str, Meta(max_length=MAX_STOP_LEN)]
        | Annotated[list[Annotated[str, Meta(max_length=MAX_STOP_LEN)]], Meta(max_length=MAX_STOP)]
        | None
    ) = None
    stop_token_ids: Annotated[list[int], Meta(max_length=1024)] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: Annotated[float, Meta(le=10.0)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Priority = 0  # vLLM's: needs --scheduling-policy priority (check_priority)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # token id (as JSON object keys are strings) -> bias
    prompt_logprobs: int | None = None  # vLLM's extension: score the prompt
    response_format: dict[str, Any] | None = (
        None  # {"type": "text" | "json_object" | "json_schema", ...}
    )
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension: a StructuredOutputs
    # OpenAI fields this server cannot honour: a 400 when set (see ``check_supported``)
    # rather than silently ignored.
    store: bool | None = None


class ChatCompletionRequest(_Sampling, frozen=True, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: str | None = None
    tools: list[Any] | None = None  # checked by structllm.tools.tool_request
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra template variables


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    # str, list[str], list[int] or list[list[int]] (msgspec unions allow one list type,
    # so the shape is checked by the app)
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`$")  # at the top level


def decode_body(body: bytes, kind: type[Any]) -> Any:
    """JSON bytes -> ``kind``; any failure is a 400 naming the field when possible."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        m = _PATH.search(str(e)) or _MISSING.search(str(e))
        param = m.group(1).split("[")[0].split(".")[0] if m else None
        raise APIError(400, f"invalid request: {e}", param=param or None) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid UTF-8: {e}") from None
    except RecursionError:
        raise APIError(400, "the body is nested too deeply") from None


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text parts joined, ``developer`` as
    ``system``; an assistant message may carry ``tool_calls`` (its content may then be
    null), and a ``tool`` message must name the call it answers (``tool_call_id``)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(
                400,
                f"messages[{i}].role must be system, developer, user, assistant or tool, got "
                f"{m.role!r}",
                param="messages",
            )
        content: str | list[dict[str, Any]] = (
            _content_parts(i, role, m.content) if isinstance(m.content, list) else m.content or ""
        )
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls is not None:
            if role != "assistant":
                raise APIError(
                    400,
                    f"messages[{i}]: only assistant messages carry tool_calls",
                    param="messages",
                )
            for k, call in enumerate(m.tool_calls):
                if call.type != "function":
                    raise APIError(
                        400,
                        f"messages[{i}].tool_calls[{k}].type must be function",
                        param="messages",
                    )
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in m.tool_calls
            ]
        if role == "tool":
            if not m.tool_call_id:
                raise APIError(
                    400,
                    f"messages[{i}]: a tool message needs tool_call_id (the id of the call it "
                    "answers)",
                    param="messages",
                )
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        if role == "assistant" and (m.reasoning or m.reasoning_content):
            msg["reasoning"] = m.reasoning or m.reasoning_content  # (harmony renders it)
        out.append(msg)
    return out


IMAGE_DETAILS = (None, "auto", "low", "high")


def _content_parts(i: int, role: str, parts: list[ContentPart]) -> str | list[dict[str, Any]]:
    """Text parts joined; with image parts, transformers' content list (text parts and
    ``{"type": "image"}``, which the chat template renders as the image placeholder)."""
    out: list[dict[str, Any]] = []
    for k, part in enumerate(parts):
        if part.type == "text" and part.text is not None:
            out.append({"type": "text", "text": part.text})
        elif part.type == "image_url":
            _image_url(i, k, role, part)
            out.append({"type": "image"})
        else:
            raise APIError(
                400,
                f"messages[{i}].content[{k}]: only text and image_url parts are supported, "
                f"got {part.type!r}",
                param="messages",
            )
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _image_url(i: int, k: int, role: str, part: ContentPart) -> str:
    where = f"messages[{i}].content[{k}]"
    if role != "user":
        raise APIError(400, f"{where}: only user messages carry images", param="messages")
    url = part.image_url
    if url is None:
        raise APIError(400, f"{where}: an image_url part needs image_url", param="messages")
    if isinstance(url, str):
        return url
    if url.detail not in IMAGE_DETAILS:
        raise APIError(
            400,
            f"{where}.image_url.detail must be auto, low or high, got {url.detail!r}",
            param="messages",
        )
    return url.url


def image_urls(messages: list[ChatMessage] | None) -> list[str]:
    """The URLs of the messages' image parts, in prompt order (as ``chat_messages``
    places their ``{"type": "image"}`` parts)."""
    out = []
    for i, m in enumerate(messages or ()):
        if isinstance(m.content, list):
            for k, part in enumerate(m.content):
                if part.type == "image_url":
                    out.append(_image_url(i, k, m.role, part))
    return out


def template_kwargs(req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` (vLLM's field: extra variables for the chat
    template, e.g. ``{"enable_thinking": false}``); 400 naming the field for a key the
    server sets itself (``messages``, ``tools``, ``add_generation_prompt``, ...)."""
    try:
        return check_template_kwargs(req.chat_template_kwargs)
    except ValueError as e:
        raise APIError(400, str(e), param="chat_template_kwargs") from None


def _logit_bias(req: ChatCompletionRequest | CompletionRequest) -> dict[int, float] | None:
    if req.logit_bias is None:
        return None
    out = {}
    for key, bias in req.logit_bias.items():
        try:
            out[int(key)] = bias
        except ValueError:
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
    return out


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """400 naming ``param`` if any id is outside ``[0, vocab_size)``."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"token id {bad} in {param} is outside the vocabulary [0, {vocab_size})",
            param=param,
        )


def requested_max_tokens(req: ChatCompletionRequest | CompletionRequest) -> tuple[int | None, str]:
    """The output length the client asked for, and the field it used."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def max_tokens_for(
    prompt_lens: list[int], requested: int | None, param: str, max_model_len: int
) -> int:
    """max_tokens for these prompts: the request's, or what the context leaves. 400
    (``context_length_exceeded``) when a prompt and its output cannot fit."""
    longest = max(prompt_lens)
    prompt_param = "messages" if param == "max_completion_tokens" else "prompt"
    if longest > max_model_len or (
        longest == max_model_len and requested != 0
    ):  # 0: score the prompt only
        raise APIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{longest} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return max_model_len - longest
    if longest + requested > max_model_len:
        raise APIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens, but you requested "
            f"{longest + requested} tokens ({longest} in the prompt, {requested} to generate)",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def check_priority(priority: int, policy: str) -> None:
    """400 (vLLM's message) for a non-zero ``priority`` under the fcfs policy."""
    if priority != 0 and policy != "priority":
        raise APIError(
            400,
            f"Got priority {priority} but Priority scheduling is not enabled.",
            param="priority",
        )


def check_supported(req: ChatCompletionRequest | CompletionRequest) -> None:
    """400 naming the first field the client set that this server cannot honour."""

    def unsupported(param: str, what: str) -> APIError:
        return APIError(400, f"{param} is not supported by this server ({what})", param=param)

    if req.store:
        raise unsupported("store", "completions are not stored")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise unsupported("suffix", "no fill-in-the-middle")
        if req.best_of is not None and req.best_of != req.n:
            raise unsupported("best_of", "use n; every completion is returned")
        return
    for name, what in (
        ("audio", "text only"),
        ("prediction", "no predicted outputs"),
        ("web_search_options", "no web search"),
        ("functions", "use tools"),
        ("function_call", "use tool_choice"),
        ("reasoning_effort", "not a reasoning model"),
    ):
        if getattr(req, name) is not None:
            raise unsupported(name, what)
    if req.modalities is not None and req.modalities != ["text"]:
        raise unsupported("modalities", "text only")


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    vocab_size: int,
    structured: StructuredOutputs | None = None,
    reasoning: Reasoning | None = None,
    defaults: dict[str, float | int] | None = None,
) -> SamplingParams:
    """The request's ``SamplingParams`` (with its ``n``, and the constraint
    ``Preprocessor.constraint`` made of it, and where its reasoning ends,
    ``Preprocessor.reasoning``); ``defaults`` stand in for the sampling parameters it
    leaves unset (``files.generation_defaults``). A rule it breaks is a 400 naming the
    request's own field."""
    d = defaults or {}
    check_supported(req)
    renamed = {"max_tokens": requested_max_tokens(req)[1]}
    prompt_logprobs = req.prompt_logprobs
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        renamed["logprobs"] = "top_logprobs"
    else:
        logprobs = req.logprobs
        if req.echo and logprobs is not None:  # the legacy shape scores the echoed prompt
            prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    try:
        sp = SamplingParams(
            n=req.n,
            temperature=d.get("temperature", 1.0) if req.temperature is None else req.temperature,
            top_p=d.get("top_p", 1.0) if req.top_p is None else req.top_p,
            top_k=max(0, int(d.get("top_k", 0)) if req.top_k is None else req.top_k),
            min_p=d.get("min_p", 0.0) if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=d.get("repetition_penalty", 1.0)
            if req.repetition_penalty is None
            else req.repetition_penalty,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            prompt_logprobs=prompt_logprobs,
            logit_bias=_logit_bias(req),
            structured_outputs=structured,
            reasoning=reasoning,
        )
        sp.check_vocab(vocab_size)
        return sp
    except ValueError as e:
        field = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
        raise APIError(
            400, str(e).removeprefix("SamplingParams."), param=renamed.get(field, field)
        ) from None
