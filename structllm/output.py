"""The output processor: engine token deltas -> per-sequence text, finish and stop.

Shared by the server and the offline API, and knows nothing of HTTP or of the event
loop. One user request (a prompt, or several prompts for ``/v1/completions``, times
``n``) fans out into one engine request per sequence (``fan_out``); each ``SequenceState``
turns the deltas of its engine request into ``SequenceUpdate``s: new text (incremental
detokenization), stop strings (the engine knows only stop *tokens*, so a stop string
ends the sequence here and the caller must abort the engine side), and the final flush
of the detokenizer. With tools, a ``ToolCallParser`` splits each sequence's text into
content and tool calls (``structllm.tools``; a family's own syntax:
``structllm.call_formats``, whose tags the detokenizer keeps), and a reply that ends
with calls finishes with ``tool_calls``. With a reasoning parser
(``structllm.reasoning``) the text is first split into the reasoning part and the
answer; tool calls are parsed from the answer only. gpt-oss's harmony output has one
parser for both (``structllm.harmony.parser``), fed the text with its special tokens
(its channel markers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from structllm.call_formats import FamilyCallParser, kept_markers, parser_for
from structllm.harmony.parser import HarmonyParser, merged
from structllm.protocol import ImageInput, LoraRef, SamplingParams, TokenLogprobs
from structllm.reasoning import THINK, Mode, ReasoningParser, Tags, kept_tags
from structllm.tokenizer import Detokenizer, Tokenizer
from structllm.tools import ToolCallDelta, ToolCallParser, ToolRequest


@dataclass
class SequenceUpdate:
    """What one sequence gained from one engine delta.

    ``text`` is new output text (possibly empty: the detokenizer may hold back an
    incomplete character or the start of a stop string); with tools, only the content
    part of it, and ``tool_calls`` the calls' new pieces; with a reasoning parser, only
    the answer, and ``reasoning`` the new reasoning text. ``abort`` is set when the
    sequence ended here (a stop string) while the engine request still runs: the caller
    must abort it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    abort: bool = False
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # of prompt tokens 1, 2, ...
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""


@dataclass
class SequenceState:
    """One engine request: the ``j``-th of ``n`` completions of prompt ``prompt_index``.

    ``index`` is the choice index in the response (``prompt_index * n + j``).
    Invariant: once ``finish_reason`` is set, ``process`` is not called again.
    ``num_reasoning_tokens``: the output tokens of the reasoning part (its tags
    included), with a reasoning parser."""

    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    detok: Detokenizer
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    tools: ToolCallParser | FamilyCallParser | None = None
    reasoning: ReasoningParser | None = None
    num_reasoning_tokens: int = 0
    images: list[ImageInput] = field(default_factory=list)  # the prompt's, for AddRequest
    priority: int = 0  # for AddRequest (lower runs earlier under the priority policy)
    harmony: HarmonyParser | None = None  # instead of ``tools`` and ``reasoning``
    lora: LoraRef | None = None  # the LoRA adapter it runs with (None: the base model)
    _undecided_tokens: int = 0  # fed before the parser knew whether they are reasoning
    _calls: list[ToolCallDelta] = field(default_factory=list)  # harmony's, not yet out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(
        self,
        token_ids: list[int],
        logprobs: list[TokenLogprobs] | None,
        finish_reason: str | None,
        stop_reason: int | None,
        num_cached_tokens: int,
        prompt_logprobs: list[TokenLogprobs] | None = None,
    ) -> SequenceUpdate:
        """Apply one engine delta (or several merged) and say what changed."""
        assert self.finish_reason is None, f"{self.request_id} already finished"
        self.num_cached_tokens = num_cached_tokens
        reasoning, text, stopped, used = self._detokenize(token_ids)
        if used < len(token_ids):  # a stop string ended it inside a multi-token delta
            token_ids = token_ids[:used]
            logprobs = logprobs[:used] if logprobs else logprobs
        self.token_ids += token_ids
        update = SequenceUpdate(
            self.index,
            text,
            token_ids,
            list(logprobs or ()),
            prompt_logprobs=list(prompt_logprobs or ()),
            reasoning=reasoning,
        )
        if stopped:
            update.abort = finish_reason is None  # the engine has not ended it itself
            self.finish_reason, self.stop_reason = "stop", self.detok.stop_str
        elif finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        if self.finish_reason is not None:
            tail = self.detok.finish()
            if self.reasoning is not None:
                r, tail = self.reasoning.feed(tail, final=True)
                update.reasoning += r
            elif self.harmony is not None:
                r, tail, calls = self.harmony.feed(tail, final=True)
                update.reasoning += r
                self._calls += calls
            update.text += tail
        if self.harmony is not None:
            update.tool_calls, self._calls = merged(self._calls), []
            if self.finish_reason == "stop" and self.harmony.calls:
                self.finish_reason = "tool_calls"
        if self.tools is not None:
            update.text, update.tool_calls = self.tools.feed(
                update.text,
                final=self.finish_reason is not None,
                cut=self.finish_reason == "length",
            )
            if self.finish_reason == "stop" and self.tools.calls:
                self.finish_reason = "tool_calls"
        update.finish_reason, update.stop_reason = self.finish_reason, self.stop_reason
        return update

    def _add(self, token_ids: list[int]) -> tuple[str, bool, int]:
        """The detokenizer's ``(text, stopped)`` for ``token_ids`` and how many of them
        it took. Several tokens at once (speculative decoding, grammar fast-forward) go
        one at a time when there are stop strings: a stop string ends the sequence at
        the token that completes it, as one token per step would."""
        if len(token_ids) <= 1 or not self.detok.stop:
            return (*self.detok.add(token_ids), len(token_ids))
        text = ""
        for i, t in enumerate(token_ids):
            piece, stopped = self.detok.add([t])
            text += piece
            if stopped:
                return text, True, i + 1
        return text, False, len(token_ids)

    def _detokenize(self, token_ids: list[int]) -> tuple[str, str, bool, int]:
        """New text as ``(reasoning, answer, stopped, tokens used)``. While the reasoning
        part may still be running, tokens go through the detokenizer one at a time, so
        that each is counted in ``num_reasoning_tokens`` or not."""
        if self.harmony is not None:
            return self._detokenize_harmony(token_ids)
        parser = self.reasoning
        if parser is None:
            text, stopped, used = self._add(token_ids)
            return "", text, stopped, used
        reasoning, content, stopped, used = [], [], False, 0
        for k, t in enumerate(token_ids):
            if parser.ended:  # the rest is answer
                text, stopped, n = self._add(token_ids[k:])
                content.append(parser.feed(text)[1])
                used += n
                break
            text, stopped = self.detok.add([t])
            used += 1
            r, c = parser.feed(text)
            reasoning.append(r)
            content.append(c)
            self._undecided_tokens += 1
            if parser.has_reasoning:
                self.num_reasoning_tokens += self._undecided_tokens
                self._undecided_tokens = 0
            elif parser.ended:
                self._undecided_tokens = 0
            if stopped:
                break
        return "".join(reasoning), "".join(content), stopped, used

    def _detokenize_harmony(self, token_ids: list[int]) -> tuple[str, str, bool, int]:
        """``_detokenize`` through the harmony parser, one token at a time: a token
        that ends inside an analysis message (or gave reasoning) is a reasoning token."""
        assert self.harmony is not None
        reasoning, content, stopped, used = [], [], False, 0
        for t in token_ids:
            text, stopped = self.detok.add([t])
            used += 1
            r, c, calls = self.harmony.feed(text)
            reasoning.append(r)
            content.append(c)
            self._calls += calls
            if r or self.harmony.in_reasoning:
                self.num_reasoning_tokens += 1
            if stopped:
                break
        return "".join(reasoning), "".join(content), stopped, used


def fan_out(
    prompts: Sequence[list[int]],
    sampling: SamplingParams,
    tokenizer: Tokenizer,
    new_request_id: Callable[[int, int], str],
    tools: ToolRequest | None = None,
    reasoning: Mode | None = None,
    images: Sequence[list[ImageInput]] = (),
    priority: int = 0,
    harmony: Callable[[], HarmonyParser] | None = None,
    reasoning_tags: Tags = THINK,
) -> list[SequenceState]:
    """One ``SequenceState`` per prompt and completion, in choice order. With ``n > 1`` and a
    seed, completion ``j`` samples with ``seed + j`` (so the ``n`` differ, and each is
    reproducible); every engine request gets ``n = 1``, and only the first of a prompt
    scores the prompt (``prompt_logprobs``). ``new_request_id(prompt_index, j)`` names
    the engine requests. With ``tools`` that allow calls, each sequence parses its
    calls; with ``reasoning`` (where its output starts), each splits off its reasoning
    part, marked by ``reasoning_tags``. ``images[pi]``: prompt ``pi``'s images (none if
    absent). Every engine request gets ``priority``. ``harmony`` makes each sequence's
    harmony parser (gpt-oss: it parses reasoning and calls both), and its text keeps the
    special tokens that parser reads."""
    n = sampling.n
    out = []
    for pi, ids in enumerate(prompts):
        for j in range(n):
            sp = sampling
            if n > 1:
                seed = None if sampling.seed is None else sampling.seed + j
                scored = sampling.prompt_logprobs if j == 0 else None
                sp = msgspec.structs.replace(sampling, n=1, seed=seed, prompt_logprobs=scored)
            skip = sp.skip_special_tokens and harmony is None
            parser = parser_for(tools) if tools is not None and tools.calls_allowed else None
            keep = kept_markers(parser, tokenizer.token_id)  # tags the parsers read
            if reasoning is not None:
                keep |= kept_tags(tokenizer.token_id, reasoning_tags)
            detok = Detokenizer(tokenizer, sp.stop, sp.include_stop_str_in_output, skip, keep)
            out.append(
                SequenceState(
                    pi * n + j,
                    pi,
                    new_request_id(pi, j),
                    ids,
                    sp,
                    detok,
                    tools=parser,
                    reasoning=(
                        None if reasoning is None else ReasoningParser(reasoning, reasoning_tags)
                    ),
                    images=list(images[pi]) if pi < len(images) else [],
                    priority=priority,
                    harmony=harmony() if harmony is not None else None,
                )
            )
    return out
