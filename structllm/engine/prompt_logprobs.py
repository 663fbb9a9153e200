"""Scoring of prompt tokens during prefill (``SamplingParams.prompt_logprobs``).

A prefill chunk of a request that asks for prompt logprobs adds one logit row per
prompt position it scores (see ``Request.prompt_logprob_span``) to the step's
``logit_rows``, after the sampling rows. The runner computes the logits of those rows a
slice at a time (so a 2048-token chunk never holds ``[2048, V]`` logits at once) and
hands each slice here, where it is reduced at once to what is sent: the actual next
token's logprob and the top-N alternatives, from the full-vocabulary log-softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from structllm.engine.request import Request
from structllm.protocol import TokenLogprobs


@dataclass
class PromptSpan:
    """``count`` consecutive logit rows scoring prompt positions ``first ..`` of ``req``."""

    req: Request
    first: int
    count: int


@dataclass
class PromptScorer:
    """Collects the scores of one step's prompt rows, given slice by slice in order."""

    spans: list[PromptSpan]
    targets: list[int] = field(init=False)  # [R]: the prompt token each row scores
    top_k: list[int] = field(init=False)  # [R]: alternatives wanted by each row
    _lp: list[float] = field(default_factory=list)
    _top_ids: list[list[int]] = field(default_factory=list)
    _top_lp: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.targets, self.top_k = [], []
        for s in self.spans:
            ids = s.req.token_ids
            self.targets += ids[s.first + 1 : s.first + 1 + s.count]
            self.top_k += [s.req.sampling.prompt_logprobs or 0] * s.count

    @property
    def num_rows(self) -> int:
        return len(self.targets)

    def add(self, logits: Tensor) -> None:
        """Score the next ``[S, V]`` float32 rows (on any device)."""
        a = len(self._lp)
        b = a + logits.shape[0]
        lp = torch.log_softmax(logits, dim=-1)  # [S, V]
        tgt = torch.tensor(self.targets[a:b], dtype=torch.long, device=lp.device)
        self._lp += lp.gather(1, tgt[:, None])[:, 0].tolist()
        k = max(self.top_k[a:b])
        if k:
            top = torch.topk(lp, k, dim=-1)  # [S, k], most likely first
            self._top_ids += top.indices.tolist()
            self._top_lp += top.values.tolist()
        else:
            self._top_ids += [[]] * (b - a)
            self._top_lp += [[]] * (b - a)

    def results(self) -> dict[str, list[TokenLogprobs]]:
        """``{request_id: scores of its span}``, once every row was added."""
        assert len(self._lp) == self.num_rows, "not every prompt row was scored"
        out: dict[str, list[TokenLogprobs]] = {}
        row = 0
        for s in self.spans:
            k = s.req.sampling.prompt_logprobs or 0
            out[s.req.request_id] = [
                TokenLogprobs(self._lp[i], self._top_ids[i][:k], self._top_lp[i][:k])
                for i in range(row, row + s.count)
            ]
            row += s.count
        return out
