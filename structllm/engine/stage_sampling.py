"""Sampling on the last pipeline stage: every sampling row is sampled where its logits
are, and only the token ids and the logprobs asked for travel back to rank 0 (a few
numbers per row instead of ``[N, V]`` float32 logits).

The last stage runs the same ``Sampler`` (seeded with the engine's seed, fed the rows in
the same order, so even unseeded draws are rank 0's) on rows that stand in for the
requests (``StageRow``). What the sampler reads of a request comes with the step
(``StepInput.last_stage_rows``, one ``RowSampling`` per row), written on rank 0 by
``StageFeed`` and kept on the last stage by ``StageSampler``:

- the request's ``SamplingParams`` (logit bias, penalties, seed, ``min_tokens``, ...)
  with its first row only;
- for a request with penalties, its token ids, each sent once (prompt tokens included,
  even those served from the prefix cache, which no stage computes): the last stage
  appends them to the request's history;
- a constrained row's grammar mask (rank 0 owns the matchers and fills the mask before
  the step goes out, as vLLM's scheduler does);
- the row's output index and, in a verified chunk, the drafts before it.

A request's state is dropped on the last stage when a later step names it in
``StepInput.released`` (rank 0 releases the requests that finished or were aborted).
Steps reach every stage in submission order, so a release never overtakes a row.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import torch
from torch import Tensor

from structllm.engine.grammar import GrammarMask
from structllm.engine.request import Request, Status
from structllm.engine.sampler import Sampler
from structllm.engine.speculative import DraftRow, SampleRow
from structllm.protocol import RowSampling, SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from structllm.structured import Matcher


def penalised(sp: SamplingParams) -> bool:
    """Whether the sampler reads the request's token ids (penalties)."""
    return sp.repetition_penalty != 1.0 or bool(sp.presence_penalty or sp.frequency_penalty)


ROW_BYTES = 600  # a RowSampling without its mask, history or settings (id, drafts, ...)


def stage_budget(max_positions: int) -> int:
    """The bytes of settings and history one step may carry: a whole context's token
    ids (so any one request's history goes in one step)."""
    return 4 * max_positions + (64 << 10)


def frame_allowance(config_rows: int, vocab_size: int, max_positions: int) -> int:
    """What ``last_stage_rows`` may add to a step's frame at most: ``config_rows``
    sampling rows, each with a grammar mask, and ``stage_budget``."""
    return config_rows * (ROW_BYTES + 4 * (-(-vocab_size // 32) + 1)) + stage_budget(max_positions)


class StageFeed:
    """Rank 0's side: the ``RowSampling`` of each row of a step, and the requests to
    release. Knows which requests the last stage holds, and how many of each one's
    token ids it has (``_known``: request id -> (request, token ids sent)).

    A step carries at most ``budget`` bytes of settings and history (the broadcast ring
    is sized for it, ``frame_allowance``). When a row's settings or the rest of its
    history do not fit, what fits goes anyway and that step is sampled on rank 0 from the
    logits (``StepInput.rank0_samples``): each such step ships ``budget`` more bytes, so
    the last stage catches up within a few steps (many penalised requests starting
    together, a logit bias larger than ``budget`` stays on rank 0)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._known: dict[str, tuple[Request, int]] = {}
        self.num_over_budget = 0  # steps left to rank 0 to sample

    def rows(
        self, reqs: Sequence[SampleRow], mask: GrammarMask | None
    ) -> tuple[list[RowSampling], list[str], bool]:
        """The rows, the released ids, and whether the last stage can sample them all."""
        released = [rid for rid, (req, _) in self._known.items() if req.status is Status.FINISHED]
        for rid in released:
            del self._known[rid]
        bits = {i: mask.bits[j].numpy().tobytes() for j, i in enumerate(mask.rows)} if mask else {}
        budget, complete = self.budget, True
        out: list[RowSampling] = []
        for i, r in enumerate(reqs):
            req = r.req if isinstance(r, DraftRow) else r
            assert isinstance(req, Request)
            rid = req.request_id
            known = self._known.get(rid)
            sampling: SamplingParams | None = None
            sent = 0
            if known is None or known[0] is not req:
                if known is not None:  # an ended request's id, reused: drop the old state
                    released.append(rid)
                    del self._known[rid]
                # the stop strings and the grammar spec are the front end's and rank 0's
                sampling = msgspec.structs.replace(
                    req.sampling, stop=[], structured_outputs=None, reasoning=None
                )
                size = len(msgspec.msgpack.encode(sampling))
                if size > budget:
                    complete = False
                    out.append(RowSampling(rid, r.num_output_tokens, None, b"", [], None))
                    continue
                budget -= size
            else:
                sent = known[1]
            new = b""
            if penalised(req.sampling) and sent < len(req.token_ids):
                take = min(len(req.token_ids) - sent, budget // 4)
                new = array("i", req.token_ids[sent : sent + take]).tobytes()
                budget -= 4 * take
                sent += take
                complete = complete and sent == len(req.token_ids)
            self._known[rid] = (req, sent)
            row = RowSampling(
                rid, r.num_output_tokens, sampling, new, list(r.drafts_before), bits.get(i)
            )
            out.append(row)
        self.num_over_budget += not complete
        return out, released, complete


class _Held:
    """What the last stage keeps of a request: its settings and (with penalties) its
    token ids so far."""

    __slots__ = ("history", "sampling")

    def __init__(self, sampling: SamplingParams) -> None:
        self.sampling = sampling
        self.history = array("i")


class StageRow:
    """A ``RowSampling`` and its request's held state, as the ``SampleRow`` the sampler
    reads."""

    __slots__ = ("_held", "_row")

    def __init__(self, held: _Held, row: RowSampling) -> None:
        self._held = held
        self._row = row

    @property
    def sampling(self) -> SamplingParams:
        return self._held.sampling

    @property
    def num_output_tokens(self) -> int:
        return self._row.step

    @property
    def token_ids(self) -> list[int]:  # prompt + output (+ the drafts before the row)
        return self._held.history.tolist() + self._row.drafts_before

    @property
    def output_token_ids(self) -> list[int]:
        step = self._row.step
        return self.token_ids[-step:] if step else []

    @property
    def grammar(self) -> Matcher | None:  # the mask comes with the row
        return None

    @property
    def drafts_before(self) -> Sequence[int]:
        return self._row.drafts_before

    @property
    def in_reasoning(self) -> bool:  # (rank 0 decided: a row in its reasoning has no mask)
        return False


class StageSampler:
    """The last stage's side (its TP rank 0): the requests' state, and the sampling of a
    step's rows into the message for rank 0."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._held: dict[str, _Held] = {}

    @property
    def num_held(self) -> int:
        return len(self._held)

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._held.pop(rid, None)

    def ingest(self, rows: Sequence[RowSampling]) -> None:
        """Take in the settings and history a step's rows carry (a row of a request this
        stage does not hold yet, in a step rank 0 samples, carries nothing)."""
        for row in rows:
            if row.sampling is not None:
                self._held[row.request_id] = _Held(row.sampling)
            if row.new_tokens:
                self._held[row.request_id].history.frombytes(row.new_tokens)

    def sample(self, logits: Tensor, rows: Sequence[RowSampling]) -> Tensor:
        """``logits: [N, V]`` float32 on the CPU, row ``i`` for ``rows[i]`` (already
        ingested). Returns ``pack`` of the sampler's answer."""
        views: list[StageRow] = []
        mask_rows: list[int] = []
        mask_bits: list[bytes] = []
        for i, row in enumerate(rows):
            held = self._held.get(row.request_id)
            if held is None:
                raise RuntimeError(f"the last stage holds no state for {row.request_id!r}")
            views.append(StageRow(held, row))
            if row.mask is not None:
                mask_rows.append(i)
                mask_bits.append(row.mask)
        mask = None
        if mask_rows:  # [R, W] int32
            bits = torch.frombuffer(bytearray(b"".join(mask_bits)), dtype=torch.int32)
            mask = GrammarMask(mask_rows, bits.view(len(mask_rows), -1))
        tokens, logprobs = self.sampler(logits, views, mask)
        return pack(tokens, logprobs)


def packed_size(reqs: Sequence[SampleRow]) -> int:
    """The length of ``pack``'s message for these rows (both sides know it)."""
    return sum(1 + (0 if (k := r.sampling.logprobs) is None else 1 + 2 * k) for r in reqs)


def pack(tokens: list[int], logprobs: Sequence[TokenLogprobs | None]) -> Tensor:
    """One float64 message ``[M]``: the N token ids, then for each row with logprobs (in
    row order) its token's logprob, its top ids and their logprobs. float64 holds the
    ids and the float32 logprobs exactly."""
    out: list[float] = [float(t) for t in tokens]
    for lp in logprobs:
        if lp is not None:
            out.append(lp.logprob)
            out += lp.top_ids
            out += lp.top_logprobs
    return torch.tensor(out, dtype=torch.float64)


def unpack(msg: Tensor, reqs: Sequence[SampleRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """``pack``'s inverse for the rows ``reqs`` (whose ``logprobs`` say what came)."""
    values: list[float] = msg.tolist()
    n = len(reqs)
    tokens = [int(t) for t in values[:n]]
    logprobs: list[TokenLogprobs | None] = [None] * n
    at = n
    for i, r in enumerate(reqs):
        k = r.sampling.logprobs
        if k is None:
            continue
        logprobs[i] = TokenLogprobs(
            values[at],
            [int(t) for t in values[at + 1 : at + 1 + k]],
            values[at + 1 + k : at + 1 + 2 * k],
        )
        at += 1 + 2 * k
    return tokens, logprobs
