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
test_harmony_render.py``). The markers are special tokens of gpt-oss's vocabulary; the
text is tokenized with them as such (``Tokenizer.encode``, as any chat template's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from structllm.harmony.typescript import to_typescript

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
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


def render_message(msg: Message, has_function_tools: bool = False) -> str:
    """One message, from ``<|start|>`` to its ``<|end|>`` (or ``<|call|>``)."""
    if msg.role == "tool":
        if not msg.name:
            raise ValueError("a tool's message needs the tool's name")
        head = msg.name
    else:
        head = msg.role + (f":{msg.name}" if msg.name else "")
    if msg.recipient is not None and msg.recipient != "all":
        head += f" to={msg.recipient}"
    if msg.channel is not None:
        head += CHANNEL + msg.channel
    if msg.content_type is not None:
        head += " " + msg.content_type
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
    end = CALL if msg.role == "assistant" and msg.recipient is not None else END
    return START + head + MESSAGE + body + end


def _has_function_tools(messages: Sequence[Message]) -> bool:
    return any(
        isinstance(m.content, DeveloperContent)
        and any(ns.name == "functions" and ns.tools for ns in m.content.tools)
        for m in messages
    )


def render_conversation(messages: Sequence[Message], auto_drop_analysis: bool = True) -> str:
    """The messages in order. ``auto_drop_analysis`` (harmony's option): when the last
    assistant message is on the ``final`` channel, the ``analysis`` messages before the
    first ``final`` one are left out (a finished answer's chain of thought)."""
    tools = _has_function_tools(messages)
    last = next((m for m in reversed(messages) if m.role == "assistant"), None)
    drop_before = -1
    if auto_drop_analysis and last is not None and last.channel == "final":
        drop_before = next(i for i, m in enumerate(messages) if m.channel == "final")
    return "".join(
        render_message(m, tools)
        for i, m in enumerate(messages)
        if not (i < drop_before and m.channel == "analysis")
    )


def render_for_completion(
    messages: Sequence[Message], next_role: str = "assistant", auto_drop_analysis: bool = True
) -> str:
    """The conversation, then ``<|start|>`` and the role of the turn to be sampled."""
    return render_conversation(messages, auto_drop_analysis) + START + next_role
