"""The output processor: engine token deltas -> per-sequence text, finish and stop.

Shared by the server and the offline API, and knows nothing of HTTP or of the event
loop. One user request (a prompt, or several prompts for ``/v1/completions``, times
``n``) fans out into one engine request per sequence (``fan_out``); each ``SequenceState``
turns the deltas of its engine request into ``SequenceUpdate``s: new text (incremental
detokenization), stop strings (the engine knows only stop *tokens*, so a stop string
ends the sequence here and the caller must abort the engine side), and the final flush
of the detokenizer. With tools, a ``ToolCallParser`` splits each sequence's text into
content and tool calls (``structllm.tools``), and a reply that ends with calls finishes
with ``tool_calls``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from structllm.protocol import SamplingParams, TokenLogprobs
from structllm.tokenizer import Detokenizer, Tokenizer
from structllm.tools import ToolCallDelta, ToolCallParser, ToolRequest


@dataclass
class SequenceUpdate:
    """What one sequence gained from one engine delta.

    ``text`` is new output text (possibly empty: the detokenizer may hold back an
    incomplete character or the start of a stop string); with tools, only the content
    part of it, and ``tool_calls`` the calls' new pieces. ``abort`` is set when the
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


@dataclass
class SequenceState:
    """One engine request: the ``j``-th of ``n`` completions of prompt ``prompt_index``.

    ``index`` is the choice index in the response (``prompt_index * n + j``).
    Invariant: once ``finish_reason`` is set, ``process`` is not called again."""

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
    tools: ToolCallParser | None = None

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
        if len(token_ids) > 1 and self.detok.stop:
            # several tokens at once (speculative decoding, grammar fast-forward): a stop
            # string ends the sequence at the token that completes it, as one token per
            # step would, so the ids and logprobs after it are dropped
            text, stopped = "", False
            for i, t in enumerate(token_ids):
                piece, stopped = self.detok.add([t])
                text += piece
                if stopped:
                    token_ids = token_ids[: i + 1]
                    logprobs = logprobs[: i + 1] if logprobs else logprobs
                    break
        else:
            text, stopped = self.detok.add(token_ids)
        self.token_ids += token_ids
        update = SequenceUpdate(
            self.index,
            text,
            token_ids,
            list(logprobs or ()),
            prompt_logprobs=list(prompt_logprobs or ()),
        )
        if stopped:
            update.abort = finish_reason is None  # the engine has not ended it itself
            self.finish_reason, self.stop_reason = "stop", self.detok.stop_str
        elif finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        if self.finish_reason is not None:
            update.text += self.detok.finish()
        if self.tools is not None:
            update.text, update.tool_calls = self.tools.feed(
                update.text, final=self.finish_reason is not None
            )
            if self.finish_reason == "stop" and self.tools.calls:
                self.finish_reason = "tool_calls"
        update.finish_reason, update.stop_reason = self.finish_reason, self.stop_reason
        return update


def fan_out(
    prompts: Sequence[list[int]],
    sampling: SamplingParams,
    tokenizer: Tokenizer,
    new_request_id: Callable[[int, int], str],
    tools: ToolRequest | None = None,
) -> list[SequenceState]:
    """One ``SequenceState`` per prompt and completion, in choice order. With ``n > 1`` and a
    seed, completion ``j`` samples with ``seed + j`` (so the ``n`` differ, and each is
    reproducible); every engine request gets ``n = 1``, and only the first of a prompt
    scores the prompt (``prompt_logprobs``). ``new_request_id(prompt_index, j)`` names
    the engine requests. With ``tools`` that allow calls, each sequence parses its
    calls."""
    n = sampling.n
    out = []
    for pi, ids in enumerate(prompts):
        for j in range(n):
            sp = sampling
            if n > 1:
                seed = None if sampling.seed is None else sampling.seed + j
                scored = sampling.prompt_logprobs if j == 0 else None
                sp = msgspec.structs.replace(sampling, n=1, seed=seed, prompt_logprobs=scored)
            detok = Detokenizer(
                tokenizer, sp.stop, sp.include_stop_str_in_output, sp.skip_special_tokens
            )
            parser = ToolCallParser(tools) if tools is not None and tools.calls_allowed else None
            out.append(
                SequenceState(pi * n + j, pi, new_request_id(pi, j), ids, sp, detok, tools=parser)
            )
    return out
