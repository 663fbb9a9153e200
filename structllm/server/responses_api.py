"""The Responses API's request: its body, its checks, and its translation to a chat request.

``POST /v1/responses`` runs over the chat pipeline: the body decodes into a
``ResponsesRequest`` (types, and this server's limits); ``chat_request`` turns its
``input`` items (after the stored conversation of ``previous_response_id``, if any),
``instructions``, flat function ``tools``, ``tool_choice`` and ``text.format`` into a
``ChatCompletionRequest``, which the chat template, the tool formats, structured output
and the sampling rules then treat as any chat request. A 400 raised by those names the
chat field; ``rename_param`` turns it back into the Responses field.

Sans-IO: no event loop, no sockets.

Conversation items (what ``input`` holds, what a response's ``output`` holds, and what
the store keeps for ``previous_response_id``) are plain dicts in OpenAI's shapes:
``message`` (role and content parts), ``function_call`` and ``function_call_output``.
``reasoning`` items are accepted in input and dropped from the prompt, except with
gpt-oss's harmony format, whose prompt keeps the reasoning of the turn in progress: there
an item's text is the ``reasoning`` of the assistant message that follows it, and
``reasoning.effort`` is the chat request's ``reasoning_effort``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from structllm.server.errors import APIError
from structllm.server.requests import ChatCompletionRequest, Priority, Temperature

Item = dict[str, Any]

# Request fields whose chat name differs (the 400s of the chat path name the chat field).
CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning",
}

# ``include`` entries this server accepts: nothing to add (no encrypted reasoning is
# kept; the Agents SDK asks for it with store off).
ACCEPTED_INCLUDES = frozenset({"reasoning.encrypted_content"})

# OpenAI refuses a smaller ``max_output_tokens`` (400, ``integer_below_min_value``).
MIN_OUTPUT_TOKENS = 16


class TextConfig(msgspec.Struct, frozen=True, kw_only=True):
    format: dict[str, Any] | None = None
    verbosity: str | None = None  # a hosted model's style knob: accepted, ignored


class ResponsesRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /v1/responses``. Unknown fields are ignored (as for chat); the fields of
    hosted features this server does not have are a 400 (``check_supported``)."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None  # >= MIN_OUTPUT_TOKENS (check_supported)
    temperature: Temperature | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no key: accepted, ignored
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None  # a hosted service's tier: accepted, ignored
    stream_options: dict[str, Any] | None = None  # include_obfuscation: accepted, ignored
    # not honoured: a 400 when set
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: Any = None
    # vLLM-style extensions, as on chat
    seed: int | None = None
    ignore_eos: bool = False
    priority: Priority = 0  # needs --scheduling-policy priority, as on chat
    structured_outputs: dict[str, Any] | None = None


def check_supported(req: ResponsesRequest) -> None:
    """400 naming the first field set that this server cannot honour."""

    def unsupported(param: str, what: str) -> APIError:
        return APIError(400, f"{param} is not supported by this server ({what})", param=param)

    n = req.max_output_tokens
    if n is not None and n < MIN_OUTPUT_TOKENS:  # OpenAI's message and code
        raise APIError(
            400,
            "Invalid 'max_output_tokens': integer below minimum value. "
            f"Expected a value >= {MIN_OUTPUT_TOKENS}, but got {n} instead.",
            param="max_output_tokens",
            code="integer_below_min_value",
        )
    if req.truncation not in (None, "disabled"):
        raise unsupported("truncation", 'only "disabled": a prompt that does not fit is a 400')
    if req.conversation is not None:
        raise unsupported("conversation", "use previous_response_id")
    if req.prompt is not None:
        raise unsupported("prompt", "no stored prompt templates")
    if req.max_tool_calls is not None:
        raise unsupported("max_tool_calls", "the model's calls are not capped")
    if req.top_logprobs:
        raise unsupported("top_logprobs", "no logprobs on this endpoint")
    if req.context_management is not None:
        raise unsupported("context_management", "no server-side compaction")
    for entry in req.include or ():
        if entry not in ACCEPTED_INCLUDES:
            raise APIError(400, f"include: {entry!r} is not supported", param="include")
    if req.background and not req.store:
        raise APIError(400, "background requires store to be true", param="background")


# -- input items -> chat messages ---------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def normalize_input(value: str | list[dict[str, Any]]) -> list[Item]:
    """``input`` as items (a string is one user message), each checked for shape and
    given an ``id`` if it has none (what ``input_items`` lists). 400 naming ``input``."""
    if isinstance(value, str):
        return [_message("user", [{"type": "input_text", "text": value}], new_id("msg"))]
    if not value:
        raise APIError(400, "input must not be an empty list", param="input")
    return [_normalize_item(i, item) for i, item in enumerate(value)]


def _message(role: str, content: list[dict[str, Any]], item_id: str) -> Item:
    return {"type": "message", "id": item_id, "role": role, "content": content}


def _bad(i: int, what: str) -> APIError:
    return APIError(400, f"input[{i}]: {what}", param="input")


def _normalize_item(i: int, item: Any) -> Item:
    if not isinstance(item, Mapping):
        raise _bad(i, f"an item must be an object, got {type(item).__name__}")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise _bad(i, f"role must be system, developer, user or assistant, got {role!r}")
        content = item.get("content")
        part_type = "output_text" if role == "assistant" else "input_text"
        if isinstance(content, str):
            parts = [{"type": part_type, "text": content}]
        elif isinstance(content, list):
            parts = [_content_part(i, k, p, role, part_type) for k, p in enumerate(content)]
        else:
            raise _bad(i, "content must be a string or a list of content parts")
        out = _message(role, parts, str(item.get("id") or new_id("msg")))
        if role == "assistant":
            out["status"] = "completed"
        return out
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise _bad(i, f"a function_call item needs {key} (a string)")
        return {
            "type": "function_call",
            "id": str(item.get("id") or new_id("fc")),
            "call_id": item["call_id"],
            "name": item["name"],
            "arguments": item["arguments"],
            "status": "completed",
        }
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):  # content parts: their text
            output = "".join(
                p.get("text", "") for p in output if isinstance(p, Mapping) and "text" in p
            )
        if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
            raise _bad(i, "a function_call_output item needs call_id and output (strings)")
        return {
            "type": "function_call_output",
            "id": str(item.get("id") or new_id("fco")),
            "call_id": item["call_id"],
            "output": output,
            "status": "completed",
        }
    if kind == "reasoning":
        return dict(item)  # kept in the conversation; not part of the prompt
    raise _bad(
        i,
        f"items must be message, function_call, function_call_output or reasoning, got {kind!r}",
    )


def _content_part(i: int, k: int, p: Any, role: str, part_type: str) -> dict[str, Any]:
    """One part of a message's content: text (as ``part_type``), or for a user message an
    ``input_image`` (its ``image_url``: a data: URL, or a URL the server may fetch)."""
    kind = p.get("type") if isinstance(p, Mapping) else type(p).__name__
    if kind == "input_image" and isinstance(p, Mapping):
        if role != "user":
            raise _bad(i, f"content[{k}]: only user messages carry images")
        if p.get("file_id") is not None:
            raise _bad(i, f"content[{k}]: file_id is not supported (no file store); give image_url")
        url, detail = p.get("image_url"), p.get("detail", "auto")
        if not isinstance(url, str):
            raise _bad(i, f"content[{k}]: an input_image needs image_url (a string)")
        if detail not in ("auto", "low", "high"):
            raise _bad(i, f"content[{k}]: detail must be auto, low or high, got {detail!r}")
        return {"type": "input_image", "image_url": url, "detail": detail}
    if (
        not isinstance(p, Mapping)
        or kind not in ("input_text", "output_text", "text", "refusal")
        or not isinstance(p.get("text", p.get("refusal")), str)
    ):
        raise _bad(i, f"content[{k}]: only text and input_image parts are supported, got {kind!r}")
    return {"type": part_type, "text": p["text"] if "text" in p else p["refusal"]}


def _chat_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's parts as chat content: the text joined, or with images chat's parts."""
    if all(p["type"] != "input_image" for p in parts):
        return "".join(p["text"] for p in parts)
    return [
        {"type": "image_url", "image_url": {"url": p["image_url"], "detail": p["detail"]}}
        if p["type"] == "input_image"
        else {"type": "text", "text": p["text"]}
        for p in parts
    ]


def chat_messages(
    instructions: str | None, items: list[Item], reasoning: bool = False
) -> list[dict[str, Any]]:
    """The chat messages (``ChatMessage`` dicts) of a conversation: ``instructions``
    first as a system message, then each item; consecutive function calls become one
    assistant message with ``tool_calls`` (joined to the assistant text just before
    them), each function output a ``tool`` message. With ``reasoning``, a reasoning
    item's text is the ``reasoning`` of the assistant message that follows it."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    thought = ""  # a reasoning item's text, for the next assistant message
    for item in items:
        kind = item["type"]
        if kind == "reasoning" and reasoning:
            thought += _reasoning_text(item)
            continue
        if thought and (kind == "function_call" or item.get("role") == "assistant"):
            out.append({"role": "assistant", "content": None, "reasoning": thought})
            thought = ""
        if kind == "message":
            last = out[-1] if out else None
            if (
                item["role"] == "assistant"
                and last is not None
                and last.get("reasoning")
                and last["content"] is None
                and "tool_calls" not in last
            ):
                last["content"] = _chat_content(item["content"])  # after its reasoning
            else:
                out.append({"role": item["role"], "content": _chat_content(item["content"])})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def _reasoning_text(item: Item) -> str:
    """A reasoning item's text: its ``reasoning_text`` parts, else its summary."""
    parts = item.get("content") or item.get("summary") or []
    return "".join(
        p["text"] for p in parts if isinstance(p, Mapping) and isinstance(p.get("text"), str)
    )


# -- tools and text.format ----------------------------------------------------------------


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat function tools -> chat's nested ones; any other tool type is a 400."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(
                400,
                f"tools[{i}]: only function tools are supported, got {t.get('type')!r} "
                "(hosted tools such as web search and file search are not available)",
                param="tools",
            )
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        400,
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
        param="tool_choice",
    )


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """``text.format`` (flat) -> chat's ``response_format``."""
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), Mapping):
            raise APIError(400, "text.format.schema must be a JSON schema object", param="text")
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    raise APIError(
        400,
        f"text.format.type must be text, json_object or json_schema, got {kind!r}",
        param="text",
    )


def chat_request(
    req: ResponsesRequest, history: list[Item], items: list[Item], harmony: bool = False
) -> ChatCompletionRequest:
    """The chat request that produces this response: ``history`` (the stored
    conversation of ``previous_response_id``) then the new ``items``; ``harmony``: for
    gpt-oss's format (reasoning items and ``reasoning.effort`` kept)."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req.instructions, [*history, *items], harmony),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "ignore_eos": req.ignore_eos,
        "priority": req.priority,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format(req.text),
        "structured_outputs": req.structured_outputs,
        "user": req.user,
    }
    if harmony and req.reasoning is not None and req.reasoning.get("effort") is not None:
        body["reasoning_effort"] = req.reasoning["effort"]
    if not body["messages"]:
        raise APIError(400, "the conversation has no messages", param="input")
    try:
        return msgspec.convert(body, ChatCompletionRequest)
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid request: {e}", param="input") from None


def rename_param(e: APIError) -> APIError:
    """A chat-path 400 with the Responses field's name (``messages`` -> ``input``...)."""
    if e.param in CHAT_TO_RESPONSES:
        new = CHAT_TO_RESPONSES[e.param]
        e.message = e.message.replace(e.param, new)
        e.param = new
    return e
