"""A stand-in for the model runner that emits tokens without running a model.

For measuring and testing the serving path alone: the scheduler, the KV cache manager,
the rings and the front end are all real; only the forward pass is replaced by a cheap
deterministic function of each request's tokens (and an optional sleep per step, to
emulate a model's step time). The same inputs always give the same outputs, so
"greedy references" can be computed offline.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from structllm.engine.scheduler import SchedulerOutput
from structllm.engine.speculative import accept
from structllm.protocol import TokenLogprobs

# Ordinary vocabulary entries of the default tokenizer (no special tokens there).
LOW, SPAN = 300, 4000
LAYERS = 8  # slices of a step's sleep, between which a step can be cut short


def _null_alternatives(token: int, k: int) -> list[int]:
    return [token, *(LOW + (token + i) % SPAN for i in range(1, k))][:k]


class NullRunner:
    def __init__(self, step_time: float = 0.0) -> None:
        self.step_time = step_time

    @staticmethod
    def next_token(token_ids: list[int]) -> int:
        """Depends on the last two tokens and the length: cheap, deterministic."""
        a = token_ids[-1]
        b = token_ids[-2] if len(token_ids) > 1 else 7
        return LOW + (a * 2654435761 + b * 40503 + len(token_ids) * 97) % SPAN

    def execute(
        self, sched: SchedulerOutput, between_layers: Callable[[], None] | None = None
    ) -> tuple[
        dict[str, int | list[int]],
        dict[str, TokenLogprobs | list[TokenLogprobs]],
        dict[str, list[TokenLogprobs]],
    ]:
        """As ``ModelRunner.execute`` (a request's drafts are verified against the tokens
        ``next_token`` gives after each of them); prompt logprobs are ``-1.0`` per token, with the
        scored token and then ``NullRunner``-style ids as alternatives. The step's sleep
        is cut into ``LAYERS`` slices with ``between_layers`` called between them, as a
        model calls it between its layers."""
        if self.step_time:
            for i in range(LAYERS):
                if between_layers is not None and i:
                    between_layers()
                time.sleep(self.step_time / LAYERS)
        sampled: dict[str, int | list[int]] = {}
        logprobs: dict[str, TokenLogprobs | list[TokenLogprobs]] = {}
        prompt_lps: dict[str, list[TokenLogprobs]] = {}
        for req, n in sched.scheduled:
            first, count = req.prompt_logprob_span(n)
            top = req.sampling.prompt_logprobs or 0
            if count:
                prompt_lps[req.request_id] = [
                    TokenLogprobs(-1.0, _null_alternatives(t, top), [-1.0] * top)
                    for t in req.token_ids[first + 1 : first + 1 + count]
                ]
        for req in sched.sampling_requests():
            drafts = req.draft_token_ids
            rows = [self.next_token(req.token_ids)]  # (no copy of the history without drafts)
            rows += [self.next_token(req.token_ids + drafts[:j]) for j in range(1, len(drafts) + 1)]
            emitted = accept(rows, drafts) if drafts else rows
            sampled[req.request_id] = emitted if drafts else emitted[0]
            k = req.sampling.logprobs
            if k is not None:
                lps = [_null_logprobs(tok, k) for tok in emitted]
                logprobs[req.request_id] = lps if drafts else lps[0]
        return sampled, logprobs, prompt_lps


def _null_logprobs(tok: int, k: int) -> TokenLogprobs:
    alts = [tok] + [LOW + (tok + i) % SPAN for i in range(1, k)]
    return TokenLogprobs(0.0, alts[:k], [0.0] + [-10.0 - i for i in range(1, k)][: max(0, k - 1)])
