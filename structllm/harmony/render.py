"""Harmony conversations as text: gpt-oss's prompt format, as openai-harmony renders it.

A message is ``<|start|>{header}<|message|>{content}<|end|>``; the header is the role
(a tool's message: the tool's name), `` to={recipient}`` when it is addressed,
``<|channel|>{channel}`` and `` {content type}`` (``<|constrain|>json`` keeps its marker).
An assistant message to a tool ends with ``<|call|>`` instead of ``<|end|>``. The system
message says who the model is, its knowledge cutoff, the date, ``Reasoning: low|medium|
high`` and the valid channels; the developer message carries the instructions and the
function tools (``# Tools`` / ``## functions`` / ``namespace functions {...}``, the
parameters written by ``typescript.to_typescript``). A prompt for a completion ends with
``<|start|>assistant``.

Byte-equal to openai-harmony's renderings in its ``test-data`` (``tests/frontend/
test_harmony_render.py``). A rendering is also a list of parts (``*_parts``): text, and
``Marker``s, the special tokens of gpt-oss's vocabulary; ``encode_parts`` tokenizes it as
openai-harmony does, so a marker spelled in a message's text stays text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from structllm.harmony.typescript import to_typescript


class Marker(str):
    """One of harmony's markers (a special token) among a rendering's parts, which are
    otherwise text (plain ``str``)."""

    __slots__ = ()


START, END, MESSAGE = Marker("<|start|>"), Marker("<|end|>"), Marker("<|message|>")
CHANNEL, CONSTRAIN = Marker("<|channel|>"), Marker("<|constrain|>")
RETURN, CALL = Marker("<|return|>"), Marker("<|call|>")
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
EFFORTS = ("low", "medium", "high")
MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"


@dataclass(frozen=True)
class ToolDescription:
    """One function of a namespace; ``parameters`` a JSON schema object, or ``None``
    for a function without any."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None


@dataclass(frozen=True)
class ToolNamespace:
    """``## name`` in ``# Tools``: its description lines, then its functions in a
    ``namespace name {...}`` block (without functions the description is prose)."""

    name: str
    description: str | None = None
    tools: tuple[ToolDescription, ...] = ()


@dataclass(frozen=True)
class SystemContent:
    """The system message's fields; the defaults are openai-harmony's
    ``SystemContent.new()``."""

    model_identity: str | None = MODEL_IDENTITY
    knowledge_cutoff: str | None = KNOWLEDGE_CUTOFF
    conversation_start_date: str | None = None
    reasoning_effort: str | None = "medium"
    tools: tuple[ToolNamespace, ...] = ()
    valid_channels: tuple[str, ...] = ("analysis", "commentary", "final")
    channel_required: bool = True


@dataclass(frozen=True)
class DeveloperContent:
    instructions: str | None = None
    tools: tuple[ToolNamespace, ...] = ()


@dataclass(frozen=True)
class Message:
    """``role`` is system, developer, user, assistant or tool (a tool's message is
    headed by its ``name``, e.g. ``functions.get_weather``)."""

    role: str
    content: str | SystemContent | DeveloperContent
    name: str | None = None
    recipient: str | None = None
    channel: str | None = None
    content_type: str | None = None


def _tools_section(namespaces: Sequence[ToolNamespace]) -> str:
    # harmony keeps namespaces in a map keyed by name: they are written in name order
    sections = ["# Tools"]
    for ns in sorted(namespaces, key=lambda n: n.name):
        lines = [f"## {ns.name}\n"]
        for line in (ns.description or "").splitlines():
            lines.append(f"// {line}" if ns.tools else line)
        if ns.tools:
            lines.append(f"namespace {ns.name} {{\n")
            for tool in ns.tools:
                lines += [f"// {line}" for line in tool.description.splitlines()]
                if tool.parameters is not None:
                    lines.append(
                        f"type {tool.name} = (_: {to_typescript(tool.parameters)}) => any;\n"
                    )
                else:
                    lines.append(f"type {tool.name} = () => any;\n")
            lines.append(f"}} // namespace {ns.name}")
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


def _system_text(sys: SystemContent, has_function_tools: bool) -> str:
    sections = []
    top = [
        line
        for line in (
            sys.model_identity,
            sys.knowledge_cutoff and f"Knowledge cutoff: {sys.knowledge_cutoff}",
            sys.conversation_start_date and f"Current date: {sys.conversation_start_date}",
        )
        if line
    ]
    if top:
        sections.append("\n".join(top))
    if sys.reasoning_effort is not None:
        sections.append(f"Reasoning: {sys.reasoning_effort}")
    if sys.tools:
        sections.append(_tools_section(sys.tools))
    if sys.valid_channels:
        header = f"# Valid channels: {', '.join(sys.valid_channels)}."
        if sys.channel_required:
            header += " Channel must be included for every message."
        if has_function_tools:
            header += "\nCalls to these tools must go to the commentary channel: 'functions'."
        sections.append(header)
    return "\n\n".join(sections)


def _developer_text(dev: DeveloperContent) -> str:
    sections = []
    if dev.instructions is not None:
        sections += ["# Instructions", dev.instructions]
    if dev.tools:
        sections.append(_tools_section(dev.tools))
    return "\n\n".join(sections)


def message_parts(msg: Message, has_function_tools: bool = False) -> list[str]:
    """One message, from ``<|start|>`` to its ``<|end|>`` (or ``<|call|>``), as text
    and ``Marker``s."""
    if msg.role == "tool":
        if not msg.name:
            raise ValueError("a tool's message needs the tool's name")
        head = msg.name
    else:
        head = msg.role + (f":{msg.name}" if msg.name else "")
    if msg.recipient is not None and msg.recipient != "all":
        head += f" to={msg.recipient}"
    parts: list[str] = [START, head]
    if msg.channel is not None:
        parts += [CHANNEL, msg.channel]
    if msg.content_type is not None:  # <|constrain|> as its token, as harmony writes it
        rest = msg.content_type.removeprefix(CONSTRAIN)
        parts += [" ", CONSTRAIN, rest] if rest != msg.content_type else [" " + rest]
    body = _body(msg, has_function_tools)
    end = CALL if msg.role == "assistant" and msg.recipient is not None else END
    return [p for p in (*parts, MESSAGE, body, end) if p]


def _body(msg: Message, has_function_tools: bool) -> str:
    if isinstance(msg.content, SystemContent):
        if msg.role != "system":
            raise ValueError(f"system content in a {msg.role} message")
        body = _system_text(msg.content, has_function_tools)
    elif isinstance(msg.content, DeveloperContent):
        if msg.role != "developer":
            raise ValueError(f"developer content in a {msg.role} message")
        body = _developer_text(msg.content)
    else:
        body = msg.content
    return body


def render_message(msg: Message, has_function_tools: bool = False) -> str:
    """One message's text."""
    return "".join(message_parts(msg, has_function_tools))


def _has_function_tools(messages: Sequence[Message]) -> bool:
    return any(
        isinstance(m.content, DeveloperContent)
        and any(ns.name == "functions" and ns.tools for ns in m.content.tools)
        for m in messages
    )


def conversation_parts(messages: Sequence[Message], auto_drop_analysis: bool = True) -> list[str]:
    """The messages in order. ``auto_drop_analysis`` (harmony's option): when the last
    assistant message is on the ``final`` channel, the ``analysis`` messages before the
    first ``final`` one are left out (a finished answer's chain of thought)."""
    tools = _has_function_tools(messages)
    last = next((m for m in reversed(messages) if m.role == "assistant"), None)
    drop_before = -1
    if auto_drop_analysis and last is not None and last.channel == "final":
        drop_before = next(i for i, m in enumerate(messages) if m.channel == "final")
    return [
        part
        for i, m in enumerate(messages)
        if not (i < drop_before and m.channel == "analysis")
        for part in message_parts(m, tools)
    ]


def completion_parts(
    messages: Sequence[Message], next_role: str = "assistant", auto_drop_analysis: bool = True
) -> list[str]:
    """The conversation, then ``<|start|>`` and the role of the turn to be sampled."""
    return [*conversation_parts(messages, auto_drop_analysis), START, next_role]


def render_conversation(messages: Sequence[Message], auto_drop_analysis: bool = True) -> str:
    return "".join(conversation_parts(messages, auto_drop_analysis))


def render_for_completion(
    messages: Sequence[Message], next_role: str = "assistant", auto_drop_analysis: bool = True
) -> str:
    return "".join(completion_parts(messages, next_role, auto_drop_analysis))


def encode_parts(
    parts: Sequence[str],
    token_id: Callable[[str], int | None],
    encode_text: Callable[[str], list[int]],
) -> list[int]:
    """A rendering's token ids: each ``Marker`` its special token (``ValueError`` if the
    vocabulary has none), each run of text ``encode_text``'s ids, in which a marker's
    spelling is text (as openai-harmony tokenizes text: a message cannot forge a header)."""
    ids: list[int] = []
    run: list[str] = []
    for part in (*parts, None):
        if part is not None and not isinstance(part, Marker):
            run.append(part)
            continue
        if run:
            ids += encode_text("".join(run))
            run = []
        if part is not None:
            token = token_id(part)
            if token is None:
                raise ValueError(f"harmony's {part} is not a token of this vocabulary")
            ids.append(token)
    return ids
