"""gpt-oss's output, parsed: harmony messages -> reasoning, content and tool calls.

Sans-IO, fed a sequence's text deltas in order, with the special tokens kept (the
sequence's detokenizer does not skip them). The prompt ends with ``<|start|>assistant``,
so the output opens inside a header: ``<|channel|>analysis<|message|>...<|end|>``, then
more messages, each ``<|start|>assistant`` + header + ``<|message|>`` + body, ended by
``<|end|>``, ``<|call|>`` (a call: the engine stops there) or ``<|return|>`` (the answer
is done: it stops there too). The recipient (``to=functions.NAME``) may stand before or
after the channel; ``<|constrain|>json`` is the body's content type. Header rules are
openai-harmony's (``parse_header_from_string`` in its ``src/encoding.rs``).

Where each message goes, as vLLM's ``openai_gptoss`` reasoning parser and ``openai`` tool
parser map them:

- to ``functions.NAME`` (or to the bare name of a requested tool): a tool call, its
  body the ``arguments``, announced when its header is complete (``ToolCallDelta``s
  concatenate to the arguments; a body cut by ``max_tokens`` is the call as far as
  written). With ``tool_choice`` ``none`` (``calls_allowed`` false) it is reasoning.
- to any other recipient (a built-in tool such as ``browser.search``), or not the
  assistant's (a tool's answer, which the engine's stop at ``<|call|>`` leaves out):
  reasoning.
- ``analysis``: reasoning. ``final``, ``commentary`` without a recipient (a preamble),
  or any other channel: content.

A marker cut across deltas is held back until decided, so any cut of the text gives
the same result as one delta. Output that never closes its first header holds no
harmony (a model that does not write it): if it has no marker at all it is content;
a header cut short is dropped.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from structllm.harmony.render import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START
from structllm.tools import ToolCall, ToolCallDelta

ENDS = (END, CALL, RETURN, START)  # what closes a body (<|start|>: one left unclosed)
LONGEST = max(len(m) for m in (MESSAGE, *ENDS))
ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class Header:
    role: str
    recipient: str | None
    channel: str | None
    content_type: str | None


def parse_header(text: str, role: str | None = None) -> Header:
    """A header's fields from its text (between ``<|start|>`` and ``<|message|>``);
    ``role`` when the role was written before (the prompt's ``<|start|>assistant``).
    The channel is the word after ``<|channel|>``; of the words left, a role first (or
    a tool's name: its message), then ``to=RECIPIENT`` and the content type (a last
    word without ``to=``)."""
    channel = None
    i = text.find(CHANNEL)
    if i >= 0:
        after = text[i + len(CHANNEL) :]
        n = next((k for k, ch in enumerate(after) if ch.isspace() or ch == "<"), len(after))
        channel = after[:n] or None
        text = text[:i] + after[n:]
    parts = text.strip().replace(CONSTRAIN, " " + CONSTRAIN).split()
    if role is None:
        if parts and (parts[0] in ROLES or (len(parts) > 1 and not parts[0].startswith("to="))):
            role = parts.pop(0)  # a role, or a tool's name (a tool's message)
        else:
            role = "assistant"
    elif parts and parts[0] == role:
        parts.pop(0)
    recipient = content_type = None
    if parts:
        last = parts.pop()
        if last.startswith("to="):
            recipient = last[3:]
        elif not parts:
            recipient = last
        else:
            content_type = last
            recipient = parts.pop().removeprefix("to=")
    return Header(role, recipient, channel, content_type)


@dataclass
class _Call:
    index: int
    name: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    arguments: str = ""


class HarmonyParser:
    """One sequence's output -> ``(reasoning, content, call deltas)`` per delta.

    ``reasoning`` and ``content`` hold everything returned so far; ``calls`` the calls
    made; ``in_reasoning``: the message being written is reasoning (the output
    processor counts its tokens as reasoning tokens)."""

    def __init__(
        self, tool_names: frozenset[str] = frozenset(), calls_allowed: bool = True
    ) -> None:
        self.tool_names = tool_names
        self.calls_allowed = calls_allowed
        self._state = "header"
        self._header = ""  # the open header's text so far
        self._role: str | None = "assistant"  # the first header's role is in the prompt
        self._pending = ""  # body text that may be the start of a marker
        self._sink = "content"  # the open body's kind: reasoning, content or call
        self._calls: list[_Call] = []
        self._any_message = False
        self.reasoning = ""
        self.content = ""

    @property
    def calls(self) -> list[ToolCall]:
        return [ToolCall(c.id, c.name, c.arguments) for c in self._calls]

    @property
    def has_reasoning(self) -> bool:
        return bool(self.reasoning)

    @property
    def in_reasoning(self) -> bool:
        return self._state == "body" and self._sink == "reasoning"

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[ToolCallDelta]]:
        """The next text delta (``final``: the last; what is held is then decided)."""
        out: dict[str, str] = {"reasoning": "", "content": ""}
        deltas: list[ToolCallDelta] = []
        buf = self._pending + text
        self._pending = ""
        while buf:
            if self._state == "header":
                buf = self._feed_header(buf, deltas)
            elif self._state == "body":
                buf = self._feed_body(buf, out, deltas)
            else:
                buf = self._feed_between(buf)
        if final:
            self._finish(out, deltas)
        self.reasoning += out["reasoning"]
        self.content += out["content"]
        return out["reasoning"], out["content"], merged(deltas)

    def _feed_header(self, buf: str, deltas: list[ToolCallDelta]) -> str:
        # search only where a marker can newly be (a long header stays linear)
        start = max(0, len(self._header) - LONGEST + 1)
        self._header += buf
        found = [(k, m) for m in (MESSAGE, *ENDS) if (k := self._header.find(m, start)) >= 0]
        if not found:
            return ""
        i, marker = min(found)
        if marker != MESSAGE:  # a header without a body: dropped
            rest = self._header[i:] if marker == START else self._header[i + len(marker) :]
            self._header, self._state = "", "between"
            return rest
        header = parse_header(self._header[:i], self._role)
        rest = self._header[i + len(MESSAGE) :]
        self._header, self._role, self._state = "", None, "body"
        self._any_message = True
        self._open(header, deltas)
        return rest

    def _open(self, header: Header, deltas: list[ToolCallDelta]) -> None:
        """Decide where the body of the message with ``header`` goes."""
        name = _function_name(header.recipient, self.tool_names)
        if name is not None and self.calls_allowed:
            call = _Call(len(self._calls), name)
            self._calls.append(call)
            deltas.append(ToolCallDelta(call.index, "", call.id, call.name))
            self._sink = "call"
        elif (
            header.role != "assistant"
            or header.recipient not in (None, "all", "assistant")
            or header.channel == "analysis"
        ):
            self._sink = "reasoning"
        else:
            self._sink = "content"

    def _feed_body(self, buf: str, out: dict[str, str], deltas: list[ToolCallDelta]) -> str:
        found = [(k, m) for m in ENDS if (k := buf.find(m)) >= 0]
        if found:
            k, marker = min(found)
            self._emit(buf[:k], out, deltas)
            self._state = "between"
            return buf[k:] if marker == START else buf[k + len(marker) :]
        keep = _partial_marker(buf)
        self._emit(buf[: len(buf) - keep], out, deltas)
        self._pending = buf[len(buf) - keep :]
        return ""

    def _feed_between(self, buf: str) -> str:
        head = buf.lstrip()
        if head.startswith(START):
            self._state = "header"
            return head[len(START) :]
        if not head or START.startswith(head):
            self._pending = buf  # undecided: maybe the next <|start|>
            return ""
        self._state = "header"  # a header without <|start|> (e.g. <|channel|>final...)
        return head

    def _emit(self, text: str, out: dict[str, str], deltas: list[ToolCallDelta]) -> None:
        if not text:
            return
        if self._sink == "call":
            call = self._calls[-1]
            call.arguments += text
            deltas.append(ToolCallDelta(call.index, text))
        else:
            out[self._sink] += text

    def _finish(self, out: dict[str, str], deltas: list[ToolCallDelta]) -> None:
        """The end of the output: a body's held text is its own; an unclosed first
        header without markers is plain text (the model wrote no harmony)."""
        if self._state == "body":
            self._emit(self._pending, out, deltas)
        elif self._state == "header" and not self._any_message and "<|" not in self._header:
            out["content"] += self._header
        self._pending = self._header = ""
        self._state = "between"


def _function_name(recipient: str | None, tool_names: frozenset[str]) -> str | None:
    """The function a recipient names: ``functions.NAME``, or a requested tool's bare
    name (gpt-oss sometimes drops the namespace)."""
    if recipient is None:
        return None
    if recipient.startswith("functions.") and len(recipient) > len("functions."):
        return recipient[len("functions.") :]
    return recipient if recipient in tool_names else None


def _partial_marker(text: str) -> int:
    """Length of the longest tail of ``text`` that could begin a marker (``<|...``)."""
    i = text.rfind("<")
    if i < 0:
        return 0
    tail = text[i:]
    return len(tail) if any(m.startswith(tail) for m in ENDS) else 0


def merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call as one delta (an announcement takes the text
    after it): one delta per call and feed."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            out[-1].arguments += d.arguments
        else:
            out.append(d)
    return out
