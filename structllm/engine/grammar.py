"""Constrained decoding in the engine: one ``structured.Matcher`` per constrained
sequence, the per-step token bitmask, and grammar fast-forward.

A constrained request's matcher is built off the engine thread (``compile``; from about
a millisecond up to ~0.1 s for the largest specs the limits admit), so a big grammar
never stalls the step of the others; the engine admits the request once it is ready.

A step, for the rows whose request has a matcher (nothing at all happens when no row
has one):

1. ``start_fill`` computes each constrained row's bitmask on a helper thread
   (llguidance's batch fill drops the GIL), overlapping the forward pass;
2. the sampler applies it (``apply_bitmask``) to the sanitised logits, before logprobs,
   penalties and the sampling transforms, and marks a row that has no allowed token
   left with token ``-1`` instead of sampling an illegal one;
3. the scheduler hands each sampled token to ``advance``, which feeds it to the
   matcher, ends the request when the grammar is complete (``"stop"``, winning over
   ``min_tokens`` and ``ignore_eos``) or broken (``"error"``), and otherwise appends
   the tokens the grammar forces next (fast-forward): they are computed with the next
   step's chunk, like prompt tokens, instead of one decode step each.

Only rank 0 has matchers (with pipeline stages the last stage samples, and each
constrained row's mask goes to it with the step, ``engine.stage_sampling``);
tensor-parallel workers see the forced tokens as ordinary input ids.

A request with ``sampling.reasoning`` starts in its reasoning part
(``Request.in_reasoning``): its row gets no mask and its tokens are not fed to the
matcher until the output's last tokens are the reasoning's end tokens; from the next
token on the grammar constrains it as any other (the answer after the reasoning).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance as llg
import numpy as np
import torch
from torch import Tensor

from structllm.engine.request import Request
from structllm.engine.speculative import SampleRow
from structllm.protocol import FinishReason
from structllm.structured import Matcher, grammar_of, load_tokenizer


@dataclass
class GrammarMask:
    """The allowed tokens of a step's constrained rows: bit ``t % 32`` of
    ``bits[i, t // 32]`` allows token ``t`` in logits row ``rows[i]``."""

    rows: list[int]
    bits: Tensor  # [R, W] int32, W = ceil(tokenizer vocab / 32)
    fill_s: float = 0.0  # time spent computing it (on the helper thread)
    apply_s: float = 0.0  # time spent applying it (set by apply_bitmask)


def apply_bitmask(logits: Tensor, mask: GrammarMask) -> None:
    """In place: ``-inf`` at every token ``mask`` does not allow in its rows, including
    ids past the mask's width (a model vocabulary padded beyond the tokenizer's). Other
    rows are untouched. ``logits``: ``[N, V]`` float on the CPU."""
    t0 = time.perf_counter()
    n, v = logits.shape
    r = len(mask.rows)
    # [R, W] int32 -> [R, 32W] one byte per token id: on a little-endian host, byte b of
    # word w holds ids 32w+8b .. 32w+8b+7, lowest bit first, as llguidance writes them
    unpacked = np.unpackbits(mask.bits.numpy().view(np.uint8), axis=1, bitorder="little")
    banned = ~torch.from_numpy(unpacked.view(np.bool_))
    if banned.shape[1] >= v:
        banned = banned[:, :v]
    else:
        banned = torch.cat([banned, banned.new_ones(r, v - banned.shape[1])], dim=1)
    if mask.rows == list(range(n)):
        logits.masked_fill_(banned, float("-inf"))
    else:  # row views, in place: no gather/scatter copies of [R, V]
        for j, i in enumerate(mask.rows):
            logits[i].masked_fill_(banned[j], float("-inf"))
    mask.apply_s = time.perf_counter() - t0


class GrammarManager:
    """The engine's matchers (one per live constrained request, freed when it ends) and
    the fast-forward policy. ``tokenizer_json``/``eos_token_ids``: the model's; the
    llguidance tokenizer is built on the first constrained request."""

    def __init__(
        self,
        tokenizer_json: str,
        eos_token_ids: Iterable[int],
        vocab_size: int,
        fast_forward: bool = True,
    ) -> None:
        self.tokenizer_json = tokenizer_json
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.vocab_size = vocab_size
        self.fast_forward = fast_forward
        self.matchers: dict[str, Matcher] = {}
        self.num_ff_tokens = 0  # tokens appended by fast-forward = decode steps saved
        self.fill_s = 0.0  # cumulative mask time, for benchmarks
        self.apply_s = 0.0
        self.num_mask_steps = 0
        self._tokenizer: llg.LLTokenizer | None = None
        self._executor: llg.LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._compiler: ThreadPoolExecutor | None = None

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        if self._tokenizer is None:
            tok = load_tokenizer(self.tokenizer_json, self.eos_token_ids)
            if self.vocab_size > tok.vocab_size:  # padded model vocabulary: cover every id
                tok = load_tokenizer(self.tokenizer_json, self.eos_token_ids, self.vocab_size)
            self._tokenizer = tok
        return self._tokenizer

    # -- lifetime ----------------------------------------------------------------------

    def compile(self, req: Request) -> Future[Matcher | str]:
        """Start building ``req``'s matcher on a helper thread. The future's result is
        the matcher, or an error message if the grammar does not compile or exceeds the
        limits; ``attach`` it once done (only then is it counted as live)."""
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")
        return self._compiler.submit(self.build, req)

    def build(self, req: Request) -> Matcher | str:
        """``req``'s matcher, or an error message naming the spec's field."""
        spec = req.sampling.structured_outputs
        assert spec is not None
        try:
            matcher = Matcher(self.tokenizer, grammar_of(spec))
        except ValueError as e:
            return str(e)
        if matcher.error is not None:
            return f"structured_outputs.{spec.kind}: {matcher.error}"
        return matcher

    def attach(self, req: Request, matcher: Matcher) -> None:
        self.matchers[req.request_id] = matcher
        req.grammar = matcher

    def free(self, req: Request) -> None:
        """Drop ``req``'s matcher (idempotent)."""
        if req.grammar is not None:
            self.matchers.pop(req.request_id, None)
            req.grammar = None

    def close(self) -> None:
        for pool in (self._thread, self._compiler):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._thread = self._compiler = None

    # -- the bitmask -------------------------------------------------------------------

    def start_fill(self, reqs: Sequence[SampleRow]) -> Future[GrammarMask] | None:
        """Start computing the bitmask of the constrained ones among ``reqs`` (row ``i``
        is ``reqs[i]``; a draft row's mask is the one after its ``drafts_before``) on
        the helper thread; ``None`` when none is constrained."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.in_reasoning]
        if not rows:
            return None
        matchers = [reqs[i].grammar for i in rows]
        drafts = [list(reqs[i].drafts_before) for i in rows]
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._thread.submit(self._fill, rows, matchers, drafts)

    def _fill(
        self, rows: list[int], matchers: list[Matcher | None], drafts: list[list[int]]
    ) -> GrammarMask:
        t0 = time.perf_counter()
        tok = self.tokenizer
        bits = torch.empty(len(rows), (tok.vocab_size + 31) // 32, dtype=torch.int32)
        if self._executor is None:
            self._executor = llg.LLExecutor()
        row_bytes = bits.shape[1] * 4
        pairs = [
            (m.llmatcher, j) for j, m in enumerate(matchers) if m is not None and not drafts[j]
        ]
        # llguidance.torch's wrapper of this call imports torch.compile; the call itself
        # writes row j at bits.data_ptr() + j * row bytes, with the GIL released
        if pairs:
            self._executor.unsafe_compute_mask_ptr(pairs, bits.data_ptr(), row_bytes, len(rows))
        for j, m in enumerate(matchers):  # draft rows: the mask after their drafts
            if m is None or not drafts[j]:
                continue
            # the scheduler kept only drafts the grammar accepts (Matcher.valid_prefix)
            lm = m.llmatcher
            consumed = lm.consume_tokens(drafts[j])
            lm.unsafe_compute_mask_ptr(bits.data_ptr() + j * row_bytes, row_bytes)
            lm.rollback(len(drafts[j]) if consumed else 0)
        return GrammarMask(rows, bits, fill_s=time.perf_counter() - t0)

    def record(self, mask: GrammarMask) -> None:
        """Add a used mask's timings to the cumulative counters."""
        self.fill_s += mask.fill_s
        self.apply_s += mask.apply_s
        self.num_mask_steps += 1

    # -- after sampling ----------------------------------------------------------------

    def advance(
        self, req: Request, token: int, reason: FinishReason | None
    ) -> tuple[list[int], FinishReason | None, str | None]:
        """Feed ``req``'s sampled ``token`` (already appended) to its matcher. ``reason``:
        what the scheduler's own stop checks decided. Returns the forced tokens to
        append after it (fast-forward; already consumed by the matcher), the finish
        reason, and an error message when the grammar broke."""
        m = req.grammar
        assert m is not None
        if req.in_reasoning:
            if not _ends_reasoning(req):
                return [], reason, None  # still reasoning: unconstrained
            req.in_reasoning = False  # the grammar starts with the next token
        elif not m.consume(token):
            return [], "error", f"the grammar refused token {token}: {m.error}"
        elif m.stopped:
            return [], "stop", None  # complete: wins over min_tokens and ignore_eos
        if reason is not None or not self.fast_forward:
            return [], reason, None
        never = frozenset((*self.eos_token_ids, *req.sampling.stop_token_ids))
        room = req.max_tokens - req.num_output_tokens
        forced = m.forced_tokens(room, never)
        self.num_ff_tokens += len(forced)
        if m.error is not None:
            return forced, "error", f"grammar fast-forward failed: {m.error}"
        if m.stopped:
            return forced, "stop", None
        if req.num_output_tokens + len(forced) >= req.max_tokens:
            return forced, "length", None
        return forced, None, None


def _ends_reasoning(req: Request) -> bool:
    """Whether ``req``'s output (its newest token included) ends with the end tokens of
    its reasoning part."""
    assert req.sampling.reasoning is not None
    end = req.sampling.reasoning.end_token_ids
    return req.num_output_tokens >= len(end) and req.token_ids[-len(end) :] == end
