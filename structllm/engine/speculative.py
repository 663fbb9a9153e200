"""Speculative decoding without a draft model: where drafts come from, which requests
draft, and how a verified step's rows become tokens. Pure Python, no tensors.

A drafting request in decode is scheduled with ``1 + k`` tokens: its newest (not yet
computed) token and ``k`` drafts (``Request.draft_token_ids``), laid out as one chunk.
Row ``j`` of that chunk has the logits of the position after draft ``j - 1``; the
sampler treats it as the request's row after the drafts ``0 .. j-1`` were emitted
(penalties over that history, the grammar's mask after them, the seeded draw of that
output index: see ``runner.DraftRow``). ``accept`` then walks the sampled rows: each
row's token is emitted, and the walk goes on only while it equals the draft it is
checked against. Every emitted token is thus exactly the one plain decoding would pick
from the same logits with the same history, so greedy and seeded outputs do not change
(and with the batch-invariant kernels the logits do not either). For an unseeded draw
the emitted token has the sampler's distribution given the history, as without drafts.
With a draft that is one token (n-gram drafts are), this accepts draft ``d`` with
probability ``p(d)``, the acceptance rate of standard speculative sampling.

Proposers (``Proposer``):

- ``NgramProposer`` (prompt lookup, vLLM's ``ngram``): the tokens that followed the
  latest earlier occurrence of the sequence's longest suffix of ``min_n .. max_n``
  tokens. An incremental index (``NgramIndex``) keeps this O(1) per step.
- ``SuffixProposer`` (``suffix``): the same longest-suffix match over this request's
  tokens and over the outputs of the last ``max_cached`` finished requests (an agent
  loop that re-emits earlier replies gets drafts from them), matched up to
  ``max_depth`` tokens; the longer match wins, the request's own on a tie.

``Drafter`` applies the policy: no drafts above ``disable_by_batch_size`` running
requests and none past a request's ``max_tokens``. How many, by one of two rules:

- With a step cost table (``Drafter.step_cost``: a step of ``r`` rows costs
  ``step_cost[r - 1]`` plain 1-row steps; set by the engine on CPU with GGUF blocks,
  where ``bench/speculative.py`` measured it): the draft length that maximises the
  step's expected tokens per unit of cost (``best_draft_length``). A request's
  acceptance is an estimate ``alpha`` of the chance that a draft is accepted given the
  one before it was (decayed counts over its recent chunks, ``DraftEstimate``); ``k``
  drafts then add ``alpha + alpha**2 + ... + alpha**k`` expected tokens. So a request
  whose drafts keep being accepted drafts up to ``num_speculative_tokens`` (8 rows on
  the AVX-512 row kernel), one with mixed luck 1-3, and a crowded step none. A request
  whose ``alpha`` falls to where even one draft alone does not pay pauses drafting for
  ``PAUSE_MIN`` output tokens, doubled at each pause in a row up to ``PAUSE_MAX``, and
  resumes from the prior. While its ``alpha`` is below ``TRUSTED_ALPHA`` (above the
  prior's, so a fresh request too) a request drafts only from a match of ``MIN_MATCH``
  tokens or more (the proposer's ``last_match``), so open text, where short matches miss, pays
  fewer rejected chunks; and while it is below ``LONG_ALPHA`` its chunk is capped
  where a wholly rejected one would cost ``REJECT_COST`` times the step without it
  (``safe_draft_length``): those chunks set the inter-token latency's tail.
- Without one (other devices, float weights): ``num_speculative_tokens`` drafts, and
  none for a request whose drafts were accepted at less than ``min_acceptance`` over
  ``acceptance_window`` drafted tokens (it tries again after ``4 * acceptance_window``
  more output tokens).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from structllm.config import SpeculativeConfig
from structllm.engine.request import Request
from structllm.protocol import SamplingParams

if TYPE_CHECKING:
    from structllm.structured import Matcher

MAX_CANDIDATES = 8  # latest occurrences of the key n-gram tried per proposal


class NgramIndex:
    """Where each ``min_n``-gram of one token sequence occurs: ``key -> positions`` of
    the token right after it (ascending). The sequence only grows (a request's tokens
    are never taken back), so ``extend`` indexes the new tail."""

    __slots__ = ("max_candidates", "min_n", "positions", "upto")

    def __init__(self, min_n: int, max_candidates: int = MAX_CANDIDATES) -> None:
        self.min_n = min_n
        self.max_candidates = max_candidates
        self.positions: dict[tuple[int, ...], list[int]] = {}
        self.upto = 0  # positions < upto are indexed

    def extend(self, tokens: Sequence[int], end: int) -> None:
        """Index the n-grams followed by a token at positions ``< end``."""
        n = self.min_n
        for i in range(max(self.upto, n), end):
            self.positions.setdefault(tuple(tokens[i - n : i]), []).append(i)
        self.upto = max(self.upto, end)

    def match(self, tokens: Sequence[int], suffix: Sequence[int], max_n: int) -> tuple[int, int]:
        """``(length, position)``: the longest (``<= max_n``, latest on ties) match of a
        tail of ``suffix`` in ``tokens`` that is followed by ``tokens[position]``;
        ``(0, 0)`` if even the ``min_n`` tail does not occur."""
        n = self.min_n
        if len(suffix) < n:
            return 0, 0
        found = self.positions.get(tuple(suffix[len(suffix) - n :]))
        if not found:
            return 0, 0
        best, where = 0, 0
        for i in reversed(found[-self.max_candidates :]):
            m = n
            while m < max_n and i - m - 1 >= 0 and m < len(suffix):
                if tokens[i - m - 1] != suffix[len(suffix) - m - 1]:
                    break
                m += 1
            if m > best:
                best, where = m, i
                if m == max_n:
                    break
        return best, where


def ngram_draft(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The n-gram proposal for ``tokens`` without an index (a reference for tests):
    up to ``k`` tokens after the latest earlier occurrence of the longest suffix of
    ``min_n .. max_n`` tokens."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = list(tokens[length - n :])
        for i in range(length - 1, n - 1, -1):  # occurrence ending before position i
            if list(tokens[i - n : i]) == tail:
                return list(tokens[i : i + k])
    return []


class Proposer(Protocol):
    # the length of the match the latest proposal came from (the drafter's gate for
    # requests not yet trusted: MIN_MATCH)
    last_match: int

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to ``k`` drafts to follow ``req.token_ids``."""
        ...

    def finish(self, req: Request) -> None:
        """``req`` has ended: drop its state (and maybe remember its output)."""
        ...


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}
        self.last_match = 0  # the length of the match the latest proposal came from

    def propose(self, req: Request, k: int) -> list[int]:
        tokens = req.token_ids
        index = self.indexes.get(req.request_id)
        if index is None:
            index = self.indexes[req.request_id] = NgramIndex(self.min_n)
        index.extend(tokens, len(tokens))
        # the suffix's own occurrence ends at len(tokens): not indexed (nothing follows)
        m, i = index.match(tokens, tokens, self.max_n)
        self.last_match = m
        return list(tokens[i : i + k]) if m else []

    def finish(self, req: Request) -> None:
        self.indexes.pop(req.request_id, None)


class SuffixProposer:
    """Longest-suffix matching over the request's own tokens and over recent requests'
    outputs (see the module docstring)."""

    def __init__(self, min_n: int, max_depth: int, max_cached: int) -> None:
        self.own = NgramProposer(min_n, max_depth)
        self.min_n, self.max_depth, self.max_cached = min_n, max_depth, max_cached
        self.history: OrderedDict[str, tuple[list[int], NgramIndex]] = OrderedDict()
        self.last_match = 0  # the length of the match the latest proposal came from

    def propose(self, req: Request, k: int) -> list[int]:
        tokens = req.token_ids
        index = self.own.indexes.get(req.request_id)
        if index is None:
            index = self.own.indexes[req.request_id] = NgramIndex(self.min_n)
        index.extend(tokens, len(tokens))
        best, where = index.match(tokens, tokens, self.max_depth)
        source: Sequence[int] = tokens
        for seq, seq_index in reversed(self.history.values()):  # newest first
            m, i = seq_index.match(seq, tokens, self.max_depth)
            if m > best:
                best, where, source = m, i, seq
        self.last_match = best
        return list(source[where : where + k]) if best else []

    def finish(self, req: Request) -> None:
        self.own.finish(req)
        if self.max_cached == 0 or req.num_output_tokens < self.min_n + 1:
            return
        out = req.output_token_ids
        index = NgramIndex(self.min_n)
        index.extend(out, len(out))
        self.history[req.request_id] = (out, index)
        while len(self.history) > self.max_cached:
            self.history.popitem(last=False)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "suffix":
        return SuffixProposer(
            config.prompt_lookup_min,
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests,
        )
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


class SampleRow(Protocol):
    """What the sampler and the grammar's mask read of a row's request: a ``Request``,
    or a ``DraftRow``."""

    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def grammar(self) -> Matcher | None: ...
    @property
    def drafts_before(self) -> Sequence[int]: ...
    @property
    def in_reasoning(self) -> bool: ...


class DraftRow:
    """Row ``j`` of a drafted request's verified chunk: the request as it would be had
    ``drafts_before`` (its first ``j`` drafts) been emitted, so the sampler applies
    penalties over that history and ``min_tokens`` and the seeded draw of that output
    index, and the grammar's mask comes after those drafts."""

    __slots__ = ("drafts_before", "req")

    def __init__(self, req: Request, drafts_before: Sequence[int]) -> None:
        self.req = req
        self.drafts_before = drafts_before

    @property
    def sampling(self) -> SamplingParams:
        return self.req.sampling

    @property
    def token_ids(self) -> list[int]:
        return self.req.token_ids + list(self.drafts_before)

    @property
    def num_output_tokens(self) -> int:
        return self.req.num_output_tokens + len(self.drafts_before)

    @property
    def output_token_ids(self) -> list[int]:
        return self.req.output_token_ids + list(self.drafts_before)

    @property
    def grammar(self) -> Matcher | None:
        return self.req.grammar

    @property
    def in_reasoning(self) -> bool:
        return self.req.in_reasoning


def accept(sampled: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a verified chunk emits: ``sampled[j]`` is the token sampled from row
    ``j`` (after drafts ``0 .. j-1``), ``len(sampled) == len(drafts) + 1``. Emits
    row by row while each sampled token equals its row's draft; the first that differs,
    or the row after the last draft, is emitted too and ends the walk."""
    out: list[int] = []
    for j, t in enumerate(sampled):
        out.append(t)
        if j == len(drafts) or t != drafts[j]:
            break
    return out


# The acceptance estimate of a request that has no chunk verified yet (or resumes after
# a pause): alpha = (hits + PRIOR_HITS) / (trials + PRIOR_TRIALS), one pseudo-trial at
# 0.5. Weak on purpose: on text that does not repeat, two rejected single drafts bring
# alpha under break-even (two 2-row steps wasted per pause); on text that does, one
# accepted chunk lifts it to 3 drafts and two to the longest.
PRIOR_HITS, PRIOR_TRIALS = 0.5, 1.0
DECAY = 0.6  # weight of the earlier chunks' counts at each new chunk
PAUSE_MIN, PAUSE_MAX = 16, 256  # output tokens without drafts after alpha fell
# With the cost table, a request whose estimate is below TRUSTED_ALPHA (a fresh one
# too: the prior's 0.5 is below it) drafts only from a match of at least MIN_MATCH
# tokens (or the proposer's longest, if shorter). Open chat (bench/speculative.py's
# chats, c=1): from a 2-token match half the drafts were rejected outright, each a token
# later than plain decoding's, and those single-token steps at 1.2-1.3x a plain step's
# cost set the chat ITL p99. Gating every request until it reached 0.7 cut rejected
# chunks from 3.7% to 0.7% of chat tokens but cost copied text 13% (interleaved, load
# ~8: grounded 1.73x -> 1.51x tok/s). Gating below 0.5 at a 4-token match left 1.8% of
# chat tokens in rejected chunks (ITL p99 1.05-1.06x plain); below 0.6 at a 5-token
# match, replayed over the logged chunks of one run: 0.57%, at 2% of copied text's
# tokens per cost.
MIN_MATCH = 5
TRUSTED_ALPHA = 0.6
# A chunk whose first draft is rejected emits one token for the whole step's cost, and
# at concurrency 1 that token's latency is the step's: the chunks that set the ITL
# tail. Below LONG_ALPHA a request drafts only as many as keep its step within
# REJECT_COST times the step without drafts (2 on the AVX-512 table, 1 on AVX2's).
# Counted on bench/speculative.py's workloads (c=1, every verified chunk logged, the
# policy replayed over the log): open chat's rejected chunks of 1.6x a step fell from
# 0.52% to 0% of its tokens, its tokens per cost 1.10 -> 1.10; copied text's tokens
# per cost 1.90 -> 1.81 (its long runs reach LONG_ALPHA within two chunks). Measured
# (3 rounds, load ~1.8), chat's ITL p99 stayed 1.05-1.06x plain decoding's with a cap
# of 1.5 or 1.3: the 2-row chunks rejected at 1.16-1.27x a step, 1-2% of chat tokens,
# are enough to lift it; copied text decoded 2.02x (1.5) and 1.99x (1.3) faster.
LONG_ALPHA = 0.8
REJECT_COST = 1.5


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a chunk of ``k`` drafts emits in expectation when each draft is accepted
    with probability ``alpha`` given the one before it was: the row after the last
    accepted draft always emits one, so ``1 + alpha + ... + alpha**k``."""
    return sum(alpha**j for j in range(k + 1))


def best_draft_length(alpha: float, limit: int, rows: int, step_cost: Sequence[float]) -> int:
    """The number of drafts (``0 .. limit``) for a request whose step already has
    ``rows`` rows (its own newest token included) that maximises the step's expected
    tokens per cost, counting each other row as one token: ``(rows - 1 + E(k)) /
    step_cost[rows + k - 1]``. Rows past the table are not served (the row kernel's
    limit)."""
    best, best_rate = 0, 0.0
    for k in range(0, min(limit, len(step_cost) - rows) + 1):
        rate = (rows - 1 + expected_tokens(alpha, k)) / step_cost[rows + k - 1]
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def safe_draft_length(rows: int, step_cost: Sequence[float]) -> int:
    """The most drafts whose step, if all of them are rejected, costs at most
    ``REJECT_COST`` times the same step without them (``rows`` as in
    ``best_draft_length``)."""
    base, k = step_cost[rows - 1], 0
    while rows + k < len(step_cost) and step_cost[rows + k] <= REJECT_COST * base:
        k += 1
    return k


class DraftEstimate:
    """A request's acceptance estimate (see ``PRIOR_HITS``): decayed counts of accepted
    drafts (``hits``) and of drafts checked (``trials``: the accepted ones and the
    first rejected one, after which nothing was checked), and the pause that follows
    a fall below break-even."""

    __slots__ = ("hits", "pause", "trials")

    def __init__(self) -> None:
        self.hits = 0.0
        self.trials = 0.0
        self.pause = PAUSE_MIN

    @property
    def alpha(self) -> float:
        return (self.hits + PRIOR_HITS) / (self.trials + PRIOR_TRIALS)

    def update(self, drafted: int, accepted: int) -> None:
        self.hits = DECAY * self.hits + accepted
        self.trials = DECAY * self.trials + accepted + (accepted < drafted)
        if accepted == drafted:
            self.pause = PAUSE_MIN

    def reset(self) -> None:
        """Back to the prior (after a pause), the next pause twice as long."""
        self.hits = self.trials = 0.0
        self.pause = min(2 * self.pause, PAUSE_MAX)


class SpecStats:
    """Cumulative counters, vLLM's ``spec_decode`` metrics."""

    def __init__(self, k: int) -> None:
        self.num_drafts = 0  # drafted chunks verified
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k  # drafts accepted at position j
        self.propose_s = 0.0  # time in the proposer


class Drafter:
    """The drafting policy and its counters (see the module docstring); the scheduler
    asks it for each decoding request's drafts and reports each verified chunk."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer or make_proposer(config)
        self.stats = SpecStats(config.num_speculative_tokens)
        # relative cost of a step by rows (index rows - 1), or None: see the module doc
        self.step_cost: Sequence[float] | None = None
        self.estimates: dict[str, DraftEstimate] = {}
        # the gate for untrusted requests: MIN_MATCH, or the longest match the
        # proposer looks for if that is shorter
        longest = (
            config.suffix_decoding_max_tree_depth
            if config.method == "suffix"
            else config.prompt_lookup_max
        )
        self.min_match = min(MIN_MATCH, longest)

    def drafts(self, req: Request, room: int, num_running: int, rows: int = 1) -> list[int]:
        """Drafts for ``req`` (a decode of one new token) within ``room`` extra tokens
        of the step's budget; ``rows``: the step's rows so far with ``req``'s newest
        token and one for each running request after it."""
        cfg = self.config
        limit = cfg.num_speculative_tokens
        if cfg.disable_by_batch_size is not None and num_running > cfg.disable_by_batch_size:
            return []
        # beyond max_tokens a draft could never be emitted (the row after the last
        # draft emits one more token)
        limit = min(limit, room, req.max_tokens - req.num_output_tokens - 1)
        if limit <= 0 or req.num_output_tokens < req.spec_resume_at:
            return []
        cost = self.step_cost
        est = None
        if cost is not None:
            est = self.estimates.get(req.request_id)
            if est is None:
                est = self.estimates[req.request_id] = DraftEstimate()
            if best_draft_length(est.alpha, 1, 1, cost) == 0:  # even alone it would not pay
                req.spec_resume_at = req.num_output_tokens + est.pause
                est.reset()
                return []
            limit = best_draft_length(est.alpha, limit, rows, cost)
            if est.alpha < LONG_ALPHA:
                limit = min(limit, safe_draft_length(rows, cost))
            if limit == 0:
                return []
        else:
            window_full = req.spec_drafted >= cfg.acceptance_window
            if window_full and req.spec_accepted < cfg.min_acceptance * req.spec_drafted:
                req.spec_resume_at = req.num_output_tokens + 4 * cfg.acceptance_window
                req.spec_drafted = req.spec_accepted = 0
                return []
        t0 = time.perf_counter()
        drafts = self.proposer.propose(req, limit)[:limit]
        self.stats.propose_s += time.perf_counter() - t0
        # not yet trusted: only drafts from a long match
        if (
            est is not None
            and est.alpha < TRUSTED_ALPHA
            and self.proposer.last_match < self.min_match
        ):
            return []
        if drafts and req.grammar is not None:  # only drafts the grammar allows
            drafts = drafts[: req.grammar.valid_prefix(drafts)]
        return drafts

    def record(self, req: Request, drafts: Sequence[int], emitted: Sequence[int]) -> None:
        """Count one verified chunk: ``emitted`` as ``accept`` returned it (possibly cut
        short by a stop)."""
        accepted = 0
        while accepted < min(len(drafts), len(emitted)) and emitted[accepted] == drafts[accepted]:
            self.stats.accepted_per_pos[accepted] += 1
            accepted += 1
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += len(drafts)
        s.num_accepted_tokens += accepted
        req.spec_drafted += len(drafts)
        req.spec_accepted += accepted
        est = self.estimates.get(req.request_id)
        if est is not None:
            est.update(len(drafts), accepted)

    def finish(self, req: Request) -> None:
        self.proposer.finish(req)
        self.estimates.pop(req.request_id, None)
