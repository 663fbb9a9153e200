"""Continuous batching under a per-step token budget, with chunked prefill and
preemption by recompute. Pure Python and deterministic; no model, no tensors.

Each step: running requests first, in admission order, each taking the tokens it still
needs (one for a decode, the rest of its prompt, capped by what is left of the budget,
for a prefill); then, if nobody had to be preempted, waiting requests in arrival order
while the budget, ``max_num_seqs`` and the KV pool allow. When a running request cannot
get a block, the newest running request is preempted: its blocks are freed, it keeps its
generated tokens, and it goes back to the front of the queue to be recomputed later
(largely from the prefix cache).

A hybrid model's request also takes a recurrent-state slot when it is admitted
(``states``, ``engine.state_cache``): none free, it waits as for a block; it gives the
slot back when it finishes, is aborted or is preempted (and is then recomputed from its
first token into a fresh state, or from a saved one). Its prefix-cache hit is cut to
the longest prefix whose last block has a saved recurrent state, which it resumes
from; each of its prefill chunks may save the state at a block boundary
(``StateCacheManager.plan_save``), hit only once the step has run (``update``).

Images (``Request.images``): with ``split_spans`` off (a model whose image tokens
attend to each other both ways, Gemma 3) a prefill chunk never splits an image's span
(``Request.span_chunk``): it stops before a span it cannot finish, and one that starts
at (or, after a prefix-cache hit, inside) a span takes the rest of it, even past what
is left of the step's budget (the step then takes nothing more: it overruns its budget
by at most one image, so no span is ever too long to run). With ``split_spans`` on (the
engine sets it when the vision model's attention is causal: SmolVLM, Qwen2.5-VL,
Mistral 3.1) a span is cut like text: each chunk scatters its own rows of the image's
encoder output, which the encoder cache holds while a running request is inside the
span (``Request.open_images``, ``EncoderCache.hold``). The encoder's work counts in
the budget: a chunk whose images are not in the encoder cache (``encoder_cache``, asked
by hash) costs their ``num_tokens`` besides its own tokens, each image once a step; when
that overruns the budget and the chunk has text before the image, it stops before it;
a split chunk starting at or inside such an image keeps to what the encoder leaves of
the budget (at least one token).

LoRA (``max_loras`` set): a waiting request whose adapter would make the running
requests' distinct adapters more than ``max_loras`` is passed over, not waited for
(``_next_waiting``); so every step holds at most that many.

A request that asks for prompt logprobs takes no prefix-cache hits over prompt
positions it has not scored yet (a cached block has K/V but no logits); its own blocks
still enter the cache for others.

Constrained requests (``Request.grammar`` set) hand each sampled token to the
``GrammarHook`` (``engine.grammar.GrammarManager``), which may end them or append the
tokens the grammar forces next; those are then scheduled like a chunk of prompt.

Speculative decoding (``drafter`` set, see ``engine.speculative``): a running request in
decode may carry drafts (``Request.draft_token_ids``) and then asks the budget for
``1 + drafts`` tokens. Drafts are trimmed to what the budget (and
``max_draft_step_tokens``, where verifying more rows stops being cheap) leaves once
every running request after it has its one token, never the real token; when the KV
pool cannot hold them they are dropped, and before anyone is preempted the drafts
already scheduled in the step give their blocks back. ``update`` takes the tokens the
walk over the verified rows emitted (``speculative.accept``), cuts them at the first
stop, counts as computed only the newest token and the accepted drafts, and gives back
the blocks that held only rejected drafts. The prefix cache registers a block only when
all its tokens are committed (``KVCacheManager`` caps at ``num_tokens``), so it never
holds a draft.

Scheduling policies (``policy``, vLLM's ``--scheduling-policy``). ``fcfs``: all of the
above. ``priority``: each request has a ``priority`` (lower runs earlier) and the order
``Request.urgency``, ``(priority, arrival)``. The waiting queue and the running list are
kept in that order, so running requests are scheduled most urgent first, waiting ones
are admitted most urgent first (a preempted request goes back where its urgency puts
it), and the victim of memory pressure (the last running request) is the least urgent,
the latest of its priority. Before the step, a waiting request that finds no seat
(``max_num_seqs``, a hybrid model's state slots) or, by an estimate, no blocks preempts
the least urgent running request if that one's priority is strictly larger
(``_displace``); equal priorities never preempt each other, so no two requests take
turns. While a strictly more urgent request waits, a less urgent running request takes
nothing in the step (``_schedule_running(pause=True)``): the newcomer's prefill runs
without those rows, which sit the step out with their state and tokens kept (a step of
their decodes beside it would lengthen the urgent request's first token). Should no
waiting request start after all (no budget left by more urgent rows, the LoRA cap),
the paused rows run in that step, so none waits on a request that cannot start.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Collection, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from structllm.engine.kv_cache import KVCacheManager
from structllm.engine.request import Request, Status
from structllm.engine.speculative import Drafter
from structllm.engine.state_cache import StateCacheManager
from structllm.protocol import FinishReason, TokenDelta, TokenLogprobs


def forced_logprobs(tokens: list[int], k: int) -> list[TokenLogprobs]:
    """Logprobs of fast-forwarded tokens: each was the only token its mask allowed, so
    its (masked) logprob is 0 and every alternative's is -inf (not listed)."""
    return [TokenLogprobs(0.0, [t] if k else [], [0.0] if k else []) for t in tokens]


class GrammarHook(Protocol):
    def advance(
        self, req: Request, token: int, reason: FinishReason | None
    ) -> tuple[list[int], FinishReason | None, str | None]: ...

    def free(self, req: Request) -> None: ...


NO_TOKEN_ALLOWED = "the grammar allows no token here (every candidate was masked)"
POLICIES = ("fcfs", "priority")


def urgency(req: Request) -> tuple[int, int]:
    return req.urgency


@dataclass
class SchedulerOutput:
    """``scheduled``: ``(request, num_new_tokens)`` in scheduling order. A request whose
    new tokens reach the end of its known tokens samples one token this step (unless
    it has ``max_tokens == 0``: then it finishes)."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # preempted before the step for a strictly more urgent waiting request (priority)
    displaced: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def sampling_requests(self) -> list[Request]:
        return [r for r, n in self.scheduled if r.samples_after(n)]


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: Iterable[int] = (),
        states: StateCacheManager | None = None,
        policy: str = "fcfs",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be fcfs or priority, got {policy!r}")
        self.policy = policy
        self.num_added = 0  # requests added so far: the next one's arrival
        self.kv = kv
        self.states = states  # hybrid models: a recurrent-state slot per running request
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt tokens of admitted requests, cumulative
        self.num_generation_tokens = 0
        self.grammar: GrammarHook | None = None  # set by the engine
        self.drafter: Drafter | None = None  # speculative decoding, set by the engine
        self.max_draft_step_tokens: int | None = None  # drafts only within (engine sets)
        # image hashes whose encoder output is cached (engine.encoder_cache; engine sets)
        self.encoder_cache: Container[str] = frozenset()
        # prefill chunks may cut an image's span (causal image attention; engine sets)
        self.split_spans = False
        # distinct LoRA adapters among the running requests at most (0: no cap; engine)
        self.max_loras = 0
        # a bidirectional model's prompts run whole, never in chunks (engine sets): one
        # longer than what is left of the step waits for the next, where it runs first,
        # over the budget if it must (as an image span does)
        self.whole_prompts = False

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        req.arrival = self.num_added
        self.num_added += 1
        self._enqueue(req)

    def _enqueue(self, req: Request, preempted: bool = False) -> None:
        """Into the waiting queue: under fcfs at the back, or at the front when it was
        preempted (it resumes first); under priority where its urgency puts it."""
        if self.policy == "priority":
            bisect.insort(self.waiting, req, key=urgency)
        elif preempted:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def _start(self, req: Request) -> None:
        """Into the running list: at the back, or under priority in urgency order."""
        if self.policy == "priority":
            bisect.insort(self.running, req, key=urgency)
        else:
            self.running.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ------------------------------------------------------------------

    def schedule(
        self, busy: Collection[str] = frozenset(), max_seqs: int | None = None
    ) -> SchedulerOutput:
        """The next step's batch. With pipeline parallelism several batches are in flight
        at once: ``busy`` names the requests of those (not scheduled again, never
        preempted: their step still writes their K/V blocks on the later stages), and
        ``max_seqs`` caps this batch's requests so the live ones spread over the
        batches in flight (see ``EngineCore``)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        cap = self.max_num_seqs if max_seqs is None else max_seqs
        if self.policy == "priority":
            out.displaced = self._displace(busy)
        free = [r for r in self.running if r.request_id not in busy] if busy else self.running
        encoded: set[str] = set()  # images whose encoder work this step already counts
        budget = self._schedule_running(out, free, budget, cap, encoded, pause=True)
        if out.preempted:
            return out
        admitted = len(out.scheduled)
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and len(out.scheduled) < cap
        ):
            nxt = self._next_waiting()
            if nxt is None:
                break
            req = nxt
            hits = self.kv.lookup(req)
            if req.wants_prompt_logprobs:  # hits only over positions already scored
                hits = hits[: req.num_prompt_logprobs // self.kv.block_size]
            if self.states is not None and hits:  # resumable only where a state was saved
                hits = hits[: self.states.longest_saved([self.kv.block_chain_id[b] for b in hits])]
            cached = len(hits) * self.kv.block_size
            n = min(req.num_tokens - cached, budget)
            if self.whole_prompts and n < req.num_tokens - cached:
                if out.scheduled:
                    break
                n = req.num_tokens - cached
            enc = 0
            if req.images:
                n, enc = self._image_chunk(req, cached, n, budget, encoded)
            if self.states is not None and not self.states.allocate(req):
                break
            if not self.kv.allocate(req, n, hits):
                if self.states is not None:
                    self.states.free_slot(req)
                break
            self.waiting.remove(req)
            if self.states is not None:
                if hits:
                    self.states.load(req, self.kv.block_chain_id[hits[-1]])
                self.states.plan_save(req, n, self.kv.block_size)
            if req.num_cached_tokens < 0:  # first admission (not a resumed preemption)
                req.num_cached_tokens = cached
                self.kv.record_admission(req, cached)
                self.num_prompt_tokens += req.prompt_len
            req.status = Status.RUNNING
            self._start(req)
            out.scheduled.append((req, n))
            budget -= n + enc
        if len(out.scheduled) == admitted and self.policy == "priority":
            # nobody started after all (no budget, LoRA cap, ...): the paused rows run
            done = {r.request_id for r, _ in out.scheduled}
            paused = [r for r in free if r.status is Status.RUNNING and r.request_id not in done]
            self._schedule_running(out, paused, budget, cap, encoded, pause=False)
        return out

    def _schedule_running(
        self,
        out: SchedulerOutput,
        free: list[Request],
        budget: int,
        cap: int,
        encoded: set[str],
        pause: bool,
    ) -> int:
        """Schedule the running requests ``free`` in order into ``out`` within ``budget``
        and ``cap``, preempting the newest of them (never one already scheduled) when
        the KV pool runs short; returns what is left of the budget. ``pause``: one that
        a strictly more urgent waiting request outranks takes nothing this step (the
        newcomer's prefill runs without it; ``_outranked``)."""
        i = 0
        while i < len(free) and budget > 0 and len(out.scheduled) < cap:
            req = free[i]
            if pause and self._outranked(req):  # it waits for the newcomer's prefill
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            enc = 0
            if req.images and req.num_computed_tokens < req.prompt_len:
                n, enc = self._image_chunk(req, req.num_computed_tokens, n, budget, encoded)
            # every running request after this one keeps room for its own token
            rest = len(free) - i - 1
            room = budget - n - rest
            rows = self.max_num_batched_tokens - budget + n + rest  # the step's so far
            if self.max_draft_step_tokens is not None:
                room = min(room, self.max_draft_step_tokens - rows)
            drafts = self._drafts(req, n, room, rows)
            if drafts and self.kv.allocate(req, n + len(drafts)):
                req.draft_token_ids = drafts
                n += len(drafts)
            while not req.draft_token_ids and not self.kv.allocate(req, n):
                if self._drop_drafts(out):  # drafts give their blocks up first
                    budget = self.max_num_batched_tokens - out.num_tokens
                    continue
                # the newest, never one already scheduled (nor one in flight)
                victim = free.pop()
                if free is not self.running:
                    self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            if self.states is not None:
                self.states.plan_save(req, n, self.kv.block_size)
            out.scheduled.append((req, n))
            budget -= n + enc
            i += 1
        return budget

    def _next_waiting(self) -> Request | None:
        """The waiting request to admit next: the first in line, or with ``max_loras``
        the first whose LoRA adapter fits (none, one a running request uses, or a new
        one while the running requests use fewer than ``max_loras``); None: nobody fits.
        So no step ever holds more than ``max_loras`` adapters, and a request over the
        cap lets the ones behind it in instead of blocking them."""
        if not self.max_loras:
            return self.waiting[0]
        used = {r.lora_uid for r in self.running if r.lora_uid}
        room = len(used) < self.max_loras
        return next((r for r in self.waiting if not r.lora_uid or room or r.lora_uid in used), None)

    def _image_chunk(
        self, req: Request, start: int, n: int, budget: int, encoded: set[str]
    ) -> tuple[int, int]:
        """``(n, encoder tokens)``: a chunk of at most ``n`` tokens from ``start`` that
        splits no image span (unless ``split_spans``), and the encoder work it brings
        (the ``num_tokens`` of its images neither cached nor already counted in
        ``encoded``, which takes them). When text then image overrun ``budget``, the
        chunk stops before the image; a split one starting inside it keeps to what the
        encoder leaves of ``budget``, one token at least."""
        if not self.split_spans:
            n = req.span_chunk(start, n)
        new = [
            im
            for im in req.images
            if im.offset < start + n
            and start < im.offset + im.length
            and im.hash not in self.encoder_cache
            and im.hash not in encoded
        ]
        enc = sum(im.num_tokens for im in new)
        if new and n + enc > budget and new[0].offset > start:
            return new[0].offset - start, 0
        if new and self.split_spans:
            n = min(n, max(1, budget - enc))
        encoded.update(im.hash for im in new)
        return n, enc

    def _drop_drafts(self, out: SchedulerOutput) -> bool:
        """Take back the drafts (and the blocks only they used) of the requests already
        scheduled in ``out``; whether there were any."""
        dropped = False
        for j, (req, n) in enumerate(out.scheduled):
            if req.draft_token_ids:
                out.scheduled[j] = (req, n - len(req.draft_token_ids))
                req.draft_token_ids = []
                self.kv.trim(req)
                dropped = True
        return dropped

    def _drafts(self, req: Request, n: int, room: int, rows: int) -> list[int]:
        """Drafts for ``req`` if it is a decode (one new token, no prompt positions left
        to score) and drafting is on, within ``room`` extra tokens; ``rows``: the
        step's tokens with ``req``'s and one for each running request after it."""
        if self.drafter is None or room <= 0 or n != 1 or self._outranked(req):
            return []  # (outranked: its drafts' blocks are a more urgent newcomer's)
        if req.num_tokens - req.num_computed_tokens != 1 or req.wants_prompt_logprobs:
            return []
        if req.grammar is not None and req.in_reasoning:
            return []  # the grammar's masks change where the reasoning ends: no drafts
        return self.drafter.drafts(req, room, len(self.running), rows)

    def _outranked(self, req: Request) -> bool:
        """Priority policy: a waiting request is strictly more urgent than ``req``."""
        return (
            self.policy == "priority"
            and bool(self.waiting)
            and self.waiting[0].priority < req.priority
        )

    def _displace(self, busy: Collection[str]) -> list[Request]:
        """Priority policy, before the step: preempt the least urgent running requests
        (not ``busy``) for waiting ones of strictly smaller priority that would find no
        seat or too few free blocks, most urgent first, while the step's budget lasts
        (a decode token per running request and the newcomers' first chunks); returns
        the preempted. A newcomer's blocks are an estimate (``_first_chunk``) against
        the blocks free now, less what the newcomers before it and a decode token of
        each running request take (an over-estimate: a less urgent one sits the step
        out, ``_outranked``)."""
        displaced: list[Request] = []
        seats = self.max_num_seqs - len(self.running)
        if self.states is not None:
            seats = min(seats, self.states.num_free_slots)
        reserved = spent = 0  # blocks and tokens the newcomers before this one take
        for head in list(self.waiting):
            while True:
                victim = next((r for r in reversed(self.running) if r.request_id not in busy), None)
                if victim is None or victim.priority <= head.priority:
                    return displaced  # nobody less urgent (than this one or any after it)
                budget = self.max_num_batched_tokens - len(self.running) - spent
                if budget <= 0:
                    return displaced  # it would not start this step anyway
                n, need = self._first_chunk(head, budget)
                growth = sum(self.kv.blocks_needed(r, 1) for r in self.running)  # decodes
                if seats > 0 and reserved + growth + need <= self.kv.num_free_blocks:
                    break
                self.running.remove(victim)
                self._preempt(victim)
                displaced.append(victim)
                seats += 1
            seats -= 1
            reserved += need
            spent += n
        return displaced

    def _first_chunk(self, req: Request, budget: int) -> tuple[int, int]:
        """``(tokens, blocks)`` of waiting ``req``'s first chunk within ``budget``, its
        prefix-cache hit taken off (as a whole: the cuts of prompt logprobs and saved
        recurrent states are not made), and the blocks it takes from the free pool,
        cached free blocks of the hit included."""
        hits = self.kv.lookup(req)
        n = min(req.num_tokens - len(hits) * self.kv.block_size, budget)
        reclaimed = sum(1 for b in hits if self.kv.ref_cnt[b] == 0)
        return n, self.kv.blocks_needed(req, n, hits) + reclaimed

    def _preempt(self, req: Request) -> None:
        req.draft_token_ids = []
        self.kv.free_blocks(req)
        if self.states is not None:  # recomputed from its first token: a fresh state
            self.states.free_slot(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        self._enqueue(req, preempted=True)
        self.num_preemptions += 1

    # -- after the model ran -----------------------------------------------------------

    def update(
        self,
        out: SchedulerOutput,
        sampled: Mapping[str, int | Sequence[int]],
        logprobs: Mapping[str, TokenLogprobs | Sequence[TokenLogprobs]] | None = None,
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None,
    ) -> list[TokenDelta]:
        """Advance the scheduled requests by what the step computed, append the sampled
        tokens (and, for constrained requests, the tokens their grammar forces next),
        finish requests that hit a stop condition, and describe it all. A sampled token
        of ``-1`` (a constrained row with nothing allowed) ends its request with an
        error. ``prompt_logprobs[id]`` holds the scores of ``req.prompt_logprob_span(n)``.
        A request that carried drafts gets the list of tokens its verified rows emitted
        (``speculative.accept``), and a list of logprobs, one per token."""
        deltas: list[TokenDelta] = []
        if self.states is not None:  # the step's saved states are written: hits from now
            self.states.commit([req for req, _ in out.scheduled])
        for req, n in out.scheduled:
            if req.status is Status.FINISHED:  # aborted while its batch was in flight
                continue
            first, count = req.prompt_logprob_span(n)
            plp = prompt_logprobs.get(req.request_id) if prompt_logprobs else None
            if count:
                assert plp is not None and len(plp) == count, "prompt logprobs missing"
                req.num_prompt_logprobs = first + count
            drafts, req.draft_token_ids = req.draft_token_ids, []
            # with drafts, what was computed depends on how many are accepted (below)
            req.num_computed_tokens += n - len(drafts) - 1 if drafts else n
            token = sampled.get(req.request_id)
            if token is None:  # a prefill chunk that does not sample
                done = req.max_tokens == 0 and req.num_computed_tokens == req.num_tokens
                if done:  # prompt only: finished once it is computed
                    self._finish(req, "length")
                if done or plp:
                    reason: FinishReason | None = "length" if done else None
                    cached = req.num_cached_tokens
                    deltas.append(
                        TokenDelta(req.request_id, [], reason, None, cached, prompt_logprobs=plp)
                    )
                continue
            lp = logprobs.get(req.request_id) if logprobs else None
            tokens = [token] if isinstance(token, int) else token
            lp_rows = [lp] if isinstance(lp, TokenLogprobs) else lp
            new, lps, reason, error, kept = self._append(req, tokens, lp_rows)
            if drafts:  # the newest token and the accepted drafts are now computed
                req.num_computed_tokens += kept
                if self.drafter is not None:
                    self.drafter.record(req, drafts, tokens[:kept])
                if reason is None:  # blocks that held only rejected drafts go back
                    self.kv.trim(req)
            if reason is not None:
                self._finish(req, reason)
            deltas.append(
                TokenDelta(
                    req.request_id,
                    new,
                    reason,
                    lps if new else None,
                    req.num_cached_tokens,
                    req.stop_reason,
                    error,
                    prompt_logprobs=plp,
                )
            )
        return deltas

    def _append(
        self, req: Request, tokens: Sequence[int], lp_rows: Sequence[TokenLogprobs] | None
    ) -> tuple[list[int], list[TokenLogprobs] | None, FinishReason | None, str | None, int]:
        """Append sampled ``tokens`` in turn, as that many decode steps would: stop at the
        first that ends the request, or after the first whose grammar forces tokens
        (appended too; the next step computes them). Returns the new tokens, their
        logprobs, the finish reason, an error and how many of ``tokens`` were kept."""
        new: list[int] = []
        lps: list[TokenLogprobs] | None = [] if lp_rows is not None else None
        reason: FinishReason | None = None
        error: str | None = None
        kept = 0
        for j, token in enumerate(tokens):
            if token < 0:
                return new, lps, "error", NO_TOKEN_ALLOWED, kept
            req.token_ids.append(token)
            self.num_generation_tokens += 1
            new.append(token)
            kept += 1
            if lps is not None and lp_rows is not None:
                lps.append(lp_rows[j])
            reason = self._stop_reason(req, token)
            forced: list[int] = []
            if req.grammar is not None and self.grammar is not None:
                forced, reason, error = self.grammar.advance(req, token, reason)
                if forced:
                    req.token_ids += forced
                    self.num_generation_tokens += len(forced)
                    new += forced
                    if lps is not None:
                        lps += forced_logprobs(forced, req.sampling.logprobs or 0)
            if reason is not None or forced:
                break
        return new, lps, reason, error, kept

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        sp = req.sampling
        if req.num_output_tokens > sp.min_tokens:
            if token in self.eos_token_ids and not sp.ignore_eos:
                return "stop"
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return "stop"
        if req.num_output_tokens >= req.max_tokens:
            return "length"
        return None

    def abort(self, request_ids: Iterable[str]) -> list[TokenDelta]:
        """Abort the given requests at once, returning all their blocks. Unknown or
        finished ids are ignored."""
        deltas = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._finish(req, "abort")
            deltas.append(TokenDelta(rid, [], "abort", None, max(req.num_cached_tokens, 0)))
        return deltas

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.kv.free_blocks(req)
        if self.states is not None:
            self.states.free_slot(req)
        if self.grammar is not None:
            self.grammar.free(req)
        if self.drafter is not None:
            req.draft_token_ids = []
            self.drafter.finish(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
