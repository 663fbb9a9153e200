"""The output processor: engine token deltas -> per-sequence text, finish and stop.

Shared by the server and the offline API, and knows nothing of HTTP or of the event
loop. One user request (a prompt, or several prompts for ``/v1/completions``, times
``n``) fans out into one engine request per sequence (``fan_out``); each ``SequenceState``
turns the deltas of its engine request into ``SequenceUpdate``s: new text (incremental
detokenization), stop strings (the engine knows only stop *tokens*, so a stop string
ends the sequence here and the caller must abort the engine side), and the final flush
of the detokenizer. Structured-output and tool-call parsing hook in here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from structllm.protocol import SamplingParams, TokenLogprobs
from structllm.tokenizer import Detokenizer, Tokenizer


@dataclass
class SequenceUpdate:
    """What one sequence gained from one engine delta.

    ``text`` is new output text (possibly empty: the detokenizer may hold back an
    incomplete character or the start of a stop string). ``abort`` is set when the
    sequence ended here (a stop string) while the engine request still runs: the caller
    must abort it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    abort: bool = False


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
    ) -> SequenceUpdate:
        """Apply one engine delta (or several merged) and say what changed."""
        assert self.finish_reason is None, f"{self.request_id} already finished"
        self.num_cached_tokens = num_cached_tokens
        self.token_ids += token_ids
        text, stopped = self.detok.add(token_ids)
        update = SequenceUpdate(self.index, text, token_ids, list(logprobs or ()))
        if stopped:
            update.abort = finish_reason is None  # the engine has not ended it itself
            self.finish_reason, self.stop_reason = "stop", self.detok.stop_str
        elif finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        if self.finish_reason is not None:
            update.text += self.detok.finish()
            update.finish_reason, update.stop_reason = self.finish_reason, self.stop_reason
        return update


def fan_out(
    prompts: Sequence[list[int]],
    sampling: SamplingParams,
    tokenizer: Tokenizer,
    new_request_id: Callable[[int, int], str],
) -> list[SequenceState]:
    """One ``SequenceState`` per prompt and completion, in choice order. With ``n > 1`` and a
    seed, completion ``j`` samples with ``seed + j`` (so the ``n`` differ, and each is
    reproducible); every engine request gets ``n = 1``. ``new_request_id(prompt_index,
    j)`` names the engine requests."""
    n = sampling.n
    out = []
    for pi, ids in enumerate(prompts):
        for j in range(n):
            sp = sampling
            if n > 1:
                seed = None if sampling.seed is None else sampling.seed + j
                sp = msgspec.structs.replace(sampling, n=1, seed=seed)
            detok = Detokenizer(tokenizer, sp.stop, sp.include_stop_str_in_output, sp.skip_special_tokens)
            out.append(SequenceState(pi * n + j, pi, new_request_id(pi, j), ids, sp, detok))
    return out
