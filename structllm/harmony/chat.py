"""An OpenAI chat conversation as a harmony prompt (what vLLM's ``harmony_utils`` builds
for gpt-oss), rendered by ``render``.

- the system message: harmony's defaults (model identity, knowledge cutoff 2024-06),
  today's date and ``Reasoning: low|medium|high`` (``reasoning_effort``, default medium);
- the first system (or developer) message's text is the developer message's
  ``# Instructions``, with the function tools (``tool_choice`` ``none`` leaves them
  out); later system messages are developer messages of their own;
- an assistant message: its ``reasoning`` on the ``analysis`` channel, its content on
  ``final`` (on ``commentary``, as a preamble, when it makes calls), each call a
  ``commentary`` message to ``functions.NAME`` with ``<|constrain|>json`` and its
  arguments;
- a tool message: from ``functions.NAME`` (the call it answers, by ``tool_call_id``) to
  the assistant on ``commentary``;
- the ``analysis`` messages before the last ``final`` one are left out (a finished
  answer's chain of thought, as harmony's ``auto_drop_analysis`` and vLLM do); those of
  the turn in progress (reasoning, a call, its result) stay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from structllm.harmony.render import (
    EFFORTS,
    DeveloperContent,
    Message,
    SystemContent,
    ToolDescription,
    ToolNamespace,
    completion_parts,
)

JSON = "<|constrain|>json"


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    raise ValueError(f"{where}: only text content is supported with the harmony format")


def function_tools(tools: Sequence[Mapping[str, Any]]) -> tuple[ToolNamespace, ...]:
    """Chat ``tools`` (checked: ``tools.tool_request``) as the ``functions`` namespace."""
    if not tools:
        return ()
    described = tuple(
        ToolDescription(
            t["function"]["name"],
            t["function"].get("description") or "",
            t["function"].get("parameters"),
        )
        for t in tools
    )
    return (ToolNamespace("functions", None, described),)


def conversation(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    effort: str | None,
    today: str,
) -> list[Message]:
    """The harmony messages of a chat request (``requests.chat_messages``' dicts).
    ``ValueError`` names the problem (an unknown effort, non-text content)."""
    if effort is not None and effort not in EFFORTS:
        raise ValueError(f"reasoning_effort must be low, medium or high, got {effort!r}")
    out = [
        Message(
            "system",
            SystemContent(conversation_start_date=today, reasoning_effort=effort or "medium"),
        )
    ]
    rest = list(messages)
    instructions = None
    if rest and rest[0]["role"] in ("system", "developer"):
        instructions = _text(rest.pop(0)["content"], "messages[0]")
    if instructions is not None or tools:
        out.append(Message("developer", DeveloperContent(instructions, function_tools(tools))))
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}
    first = len(messages) - len(rest)
    for i, m in enumerate(rest, start=first):
        out += _messages(m, names, f"messages[{i}]")
    return drop_finished_analysis(out)


def _messages(m: Mapping[str, Any], names: dict[str, str], where: str) -> list[Message]:
    role = m["role"]
    content = _text(m.get("content"), where)
    if role in ("system", "developer"):
        return [Message("developer", DeveloperContent(content))]
    if role == "user":
        return [Message("user", content)]
    if role == "tool":
        name = names.get(m.get("tool_call_id") or "") or m.get("name")
        if not name:
            raise ValueError(f"{where}: tool_call_id names no call of an earlier message")
        return [Message("tool", content, f"functions.{name}", "assistant", "commentary")]
    if role != "assistant":
        raise ValueError(f"{where}: unknown role {role!r}")
    out = []
    thought = m.get("reasoning") or m.get("reasoning_content")  # (the offline API's dicts)
    if thought:
        out.append(Message("assistant", thought, channel="analysis"))
    calls = m.get("tool_calls") or ()
    if content:
        out.append(Message("assistant", content, channel="commentary" if calls else "final"))
    for c in calls:
        fn = c["function"]
        out.append(
            Message(
                "assistant",
                fn["arguments"],
                recipient=f"functions.{fn['name']}",
                channel="commentary",
                content_type=JSON,
            )
        )
    return out


def drop_finished_analysis(messages: list[Message]) -> list[Message]:
    """Without the ``analysis`` messages before the last assistant ``final`` one."""
    last = max(
        (i for i, m in enumerate(messages) if m.role == "assistant" and m.channel == "final"),
        default=-1,
    )
    return [m for i, m in enumerate(messages) if not (i < last and m.channel == "analysis")]


def prompt_parts(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    effort: str | None,
    today: str,
) -> list[str]:
    """The prompt, then ``<|start|>assistant``, as text and markers
    (``render.encode_parts`` tokenizes it)."""
    return completion_parts(conversation(messages, tools, effort, today), auto_drop_analysis=False)


def prompt(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    effort: str | None,
    today: str,
) -> str:
    """The prompt's text."""
    return "".join(prompt_parts(messages, tools, effort, today))
