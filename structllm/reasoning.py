"""Reasoning output: a model's ``<think>...</think>`` part, split from its answer.

Sans-IO and synchronous, shared by the server, the offline API and any response format.
``ReasoningParser`` is one sequence's splitter: ``feed`` takes the sequence's text deltas
in order and returns ``(reasoning_delta, content_delta)`` for each; a tag cut across
deltas is held back until it is decided, so the concatenated deltas are the same however
the text was cut (a stream and a one-shot body agree).

Two behaviours, under vLLM's names (``--reasoning-parser``):

- ``deepseek_r1`` (and ``nemotron_v3``, ``kimi_k2``, which vLLM reads the same way): the
  output is reasoning until ``</think>``; the opening ``<think>`` is optional
  (DeepSeek-R1's template writes it into the prompt). Without ``</think>``
  (``max_tokens`` cut the reasoning) all of the output is reasoning.
- ``qwen3`` (and ``glm45``, ``glm47``, ``deepseek_v3``; ``gemma4`` with Gemma 4's own
  tags, ``Tags``): reasoning only when the output starts with ``<think>`` (after
  optional whitespace); otherwise it is all content (Qwen3 with ``enable_thinking:
  false``, GLM-4.5's ``enable_thinking``, DeepSeek-V3.1 without ``thinking``).

Both read the end of the prompt too (``Mode``): a prompt that ends with an open
``<think>`` (a template that starts the reasoning for the model) means the output
begins inside the reasoning; one that ends with ``</think>`` (Qwen3's template with
thinking switched off writes an empty ``<think></think>``) means reasoning only if the
output opens it. Whitespace between ``</think>`` and the answer is dropped; the reasoning text
is kept as written.

``Reasoning`` (``protocol``) carries the end tag's token ids to the engine, which then
applies a request's grammar only after them (``engine.grammar``): see ``engine_spec``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from structllm.protocol import Reasoning

# a reasoning part is assumed (deepseek_r1) or only if the output opens one (qwen3)
ASSUMED = ("deepseek_r1", "nemotron_v3", "kimi_k2")
PARSERS = (*ASSUMED, "qwen3", "glm45", "glm47", "deepseek_v3", "gemma4")
START_TAG = "<think>"
END_TAG = "</think>"
# Kimi K2 may open its tool calls without closing the reasoning (vLLM's kimi_k2 reads the
# reasoning as over there): the section's tag ends it and stays in the answer
TOOL_SECTION = "<|tool_calls_section_begin|>"


@dataclass(frozen=True)
class Tags:
    """A family's reasoning tags: ``start``/``end``, the tags that also end it (a tool
    call begun, which stays in the answer) and the special tokens they are made of."""

    start: str
    end: str
    also_end: tuple[str, ...]
    tokens: tuple[str, ...]


THINK = Tags(START_TAG, END_TAG, (TOOL_SECTION,), (START_TAG, END_TAG))
# Gemma 4: <|channel>thought\n...<channel|> (vLLM's gemma4 drops the "thought" label);
# a tool call ends it too
GEMMA4 = Tags("<|channel>thought\n", "<channel|>", ("<|tool_call>",), ("<|channel>", "<channel|>"))
TAGS = {"gemma4": GEMMA4}


def tags_of(parser: str) -> Tags:
    """The reasoning tags ``parser`` reads."""
    return TAGS.get(parser, THINK)


class Mode(enum.Enum):
    """Where a sequence's output starts."""

    INSIDE = "inside"  # in the reasoning (an opening tag in the output is skipped)
    MAYBE = "maybe"  # reasoning only if the output opens it with <think>


class _State(enum.Enum):
    OPENING = 0  # waiting to see whether the output starts with <think>
    REASONING = 1
    AFTER = 2  # just after </think>: dropping whitespace before the answer
    CONTENT = 3


def check_parser(name: str) -> str:
    """``name`` if it is a known parser; ``ValueError`` naming the choices otherwise."""
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; expected one of {list(PARSERS)}")
    return name


def prompt_state(prompt: str, tags: Tags = THINK) -> bool | None:
    """Whether the chat template left ``prompt`` inside a think block: ``True`` if it
    ends with an open ``<think>``, ``False`` if it ends with ``</think>`` (an empty
    ``<think></think>``: thinking switched off), ``None`` otherwise (whitespace after the
    tag does not count). Tags earlier in the prompt, in the conversation's history, do
    not matter."""
    tail = prompt.rstrip()
    if tail.endswith(tags.start.rstrip()):
        return True
    if tail.endswith(tags.end):
        return False
    return None


def mode_for(parser: str, prompt: str) -> Mode:
    """How ``parser`` reads the output of ``prompt`` (see the module's docstring)."""
    state = prompt_state(prompt, tags_of(parser))
    if state is True or (state is None and parser in ASSUMED):
        return Mode.INSIDE
    return Mode.MAYBE


def kept_tags(token_id: Callable[[str], int | None], tags: Tags = THINK) -> frozenset[int]:
    """The ids of ``<think>`` and ``</think>`` where they are single tokens (``token_id``:
    the tokenizer's): a vocabulary may mark them special, and the parser must see them
    in the text the detokenizer makes (``Detokenizer(keep=...)``)."""
    ids = (token_id(t) for t in (*tags.tokens, *tags.also_end))
    return frozenset(i for i in ids if i is not None)


def engine_spec(prompt: str, end_token_ids: Sequence[int], tags: Tags = THINK) -> Reasoning | None:
    """What the engine is told of the reasoning of ``prompt``'s output: the end tag's
    token ids, after which a constraint applies; ``None`` when the prompt ends with a
    closed think block (the output is the answer). As in vLLM, a reasoning part is
    otherwise expected, with either parser."""
    if prompt_state(prompt, tags) is False or not end_token_ids:
        return None
    return Reasoning(end_token_ids=list(end_token_ids))


class ReasoningParser:
    """One sequence's split of its output text into reasoning and content.

    ``reasoning`` and ``content`` hold everything returned so far; ``has_reasoning`` is
    whether the output has a reasoning part (known once the start is decided); ``ended``
    is whether the reasoning part is over (or was never there): later text is content.
    """

    __slots__ = ("_buf", "_state", "content", "has_reasoning", "mode", "reasoning", "tags")

    def __init__(self, mode: Mode = Mode.INSIDE, tags: Tags = THINK) -> None:
        self.mode = mode
        self.tags = tags
        self._state = _State.OPENING
        self._buf = ""  # text held back: a possible tag, or whitespace after </think>
        self.reasoning = ""
        self.content = ""
        self.has_reasoning = False

    @property
    def ended(self) -> bool:
        return self._state in (_State.AFTER, _State.CONTENT)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The next text delta of the output (``final``: the last one; held text is then
        flushed). Returns ``(reasoning_delta, content_delta)``."""
        reasoning, content = "", ""
        buf = self._buf + text
        self._buf = ""
        start, end = self.tags.start, self.tags.end
        if self._state is _State.OPENING:
            head = buf.lstrip()
            if head.startswith(start):
                self._state, self.has_reasoning = _State.REASONING, True
                buf = head[len(start) :]
            elif start.startswith(head) and not final:
                self._buf = buf  # empty, whitespace or a prefix of <think>: undecided
                return "", ""
            elif self.mode is Mode.INSIDE:
                self._state, self.has_reasoning = _State.REASONING, True
            else:
                self._state = _State.CONTENT
        if self._state is _State.REASONING:
            i = buf.find(end)
            j = min((k for k in (buf.find(t) for t in self.tags.also_end) if k >= 0), default=-1)
            if j >= 0 and (i < 0 or j < i):  # a tool call begins: so does the answer
                reasoning, buf = buf[:j], buf[j:]
                self._state = _State.CONTENT
            elif i >= 0:
                reasoning, buf = buf[:i], buf[i + len(end) :]
                self._state = _State.AFTER
            else:
                tags = (end, *self.tags.also_end)
                keep = 0 if final else max(_partial_tag(buf, t) for t in tags)
                reasoning, self._buf = buf[: len(buf) - keep], buf[len(buf) - keep :]
                buf = ""
        if self._state is _State.AFTER:
            buf = buf.lstrip()
            if buf:
                self._state = _State.CONTENT
        if self._state is _State.CONTENT:
            content = buf
        self.reasoning += reasoning
        self.content += content
        return reasoning, content


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def split(text: str, mode: Mode = Mode.INSIDE, tags: Tags = THINK) -> tuple[str, str]:
    """A whole output's ``(reasoning, content)``."""
    parser = ReasoningParser(mode, tags)
    parser.feed(text, final=True)
    return parser.reasoning, parser.content
