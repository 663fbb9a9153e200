"""Token selection from a step's logits, one row per sampling request.

Order of operations per row: sanitise NaN/Inf -> the grammar's token mask (constrained
rows only, see ``engine.grammar``) -> logprobs (if asked) -> ``logit_bias`` ->
``min_tokens`` masks EOS and stop ids -> penalties -> greedy argmax, or temperature,
top-k, top-p, min-p and a draw. A constrained row left with no allowed token gets token
``-1`` (never an illegal token); the caller ends that request with an error.

Reported logprobs are the model's before the bias and every sampling step (vLLM's
default "raw" logprobs); for a constrained row, as in vLLM, they are of the logits the
grammar allows (the mask comes first). Bias and mask commute: a banned token stays
banned whatever its bias.

Draws use the exponential-race form of categorical sampling: ``argmax(p / E)`` with
``E ~ Exp(1)`` i.i.d. picks index ``i`` with probability ``p_i``. The noise of a
request with a ``seed`` comes from its own generator, reseeded from
``(seed, output index)`` at every token, so its tokens do not depend on what else is
in the batch, nor on preemption and recompute, nor on speculative decoding: a verified
draft row (``speculative.DraftRow``) is sampled as the request after the drafts before
it, with that output index.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from structllm.engine.grammar import GrammarMask, apply_bitmask
from structllm.engine.speculative import SampleRow
from structllm.protocol import TokenLogprobs

_MASK64 = (1 << 64) - 1

# Up to this many rows the sampler's torch ops run on the calling thread alone. Each of
# them is microseconds of work ([4, 49152] float32: amax 12 us, log_softmax 0.12 ms on
# one thread), but over 32k elements torch splits it across its OpenMP threads and
# joins them, and on a shared 2-core machine the other thread is often descheduled:
# with two threads, load average 5-8, one amax took 1 ms (8 ms with libgomp's default
# spin), 2 ms of a single-stream decode step of the default model (~2 amax calls a step,
# more with logprobs or sampling). Larger batches keep torch's threads.
SINGLE_THREAD_ROWS = 16


@contextmanager
def _one_thread(rows: int, device: torch.device) -> Iterator[None]:
    """torch's CPU ops on this thread alone while ``rows`` is small (see
    ``SINGLE_THREAD_ROWS``); the thread count is put back on exit."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or rows > SINGLE_THREAD_ROWS or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _mix(seed: int, step: int) -> int:
    """A 63-bit seed for one draw of one request (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """``native``: the fused CPU ops module (``cpu_layer.cpp``) where the model runs them;
    its ``greedy_rows`` picks a step of plain greedy rows in one call."""

    def __init__(self, eos_token_ids: Iterable[int], seed: int = 0, native: Any = None) -> None:
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed
        self._row_gen = torch.Generator()
        self.native = native

    def __call__(
        self, logits: Tensor, reqs: Sequence[SampleRow], grammar: GrammarMask | None = None
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``logits: [N, V]`` float32, row ``i`` for ``reqs[i]``; ``grammar``: the allowed
        tokens of the constrained rows. Returns the chosen ids (``-1`` for a constrained
        row with nothing allowed) and, for requests that asked, their logprobs.
        ``logits`` may be modified."""
        if (
            self.native is not None
            and grammar is None
            and logits.dtype == torch.float32
            and logits.is_contiguous()
            and logits.is_cpu
            and all(map(_argmax_only, reqs))
        ):
            # plain greedy rows, a decode step's usual case: one native call (~4 us for a
            # row of 49152) instead of the torch ops below (~50 us); exactly their
            # tokens. A row with a NaN or no finite maximum (-1) takes the path below.
            tokens: list[int] = self.native.greedy_rows(logits)
            if -1 not in tokens:
                return tokens, [None] * len(tokens)
        with _one_thread(logits.shape[0], logits.device):
            return self._sample(logits, reqs, grammar)

    def _sample(
        self, logits: Tensor, reqs: Sequence[SampleRow], grammar: GrammarMask | None
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        n, vocab = logits.shape
        # max propagates NaN and shows +inf or an all -inf row: one pass, no [N, V] temporary
        if not bool(torch.isfinite(logits.amax(dim=-1)).all()):
            logits = _sanitise(logits)
        if grammar is not None:
            apply_bitmask(logits, grammar)
        lp_rows = [i for i, r in enumerate(reqs) if r.sampling.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None
        biased = [i for i, r in enumerate(reqs) if r.sampling.logit_bias]
        if biased:  # unbiased batches build nothing
            _apply_logit_bias(logits, biased, reqs)

        for i, r in enumerate(reqs):
            sp = r.sampling
            if r.num_output_tokens < sp.min_tokens:
                eos = [] if sp.ignore_eos else self.eos_token_ids
                banned = [t for t in (*eos, *sp.stop_token_ids) if t < vocab]
                if banned:
                    logits[i, banned] = float("-inf")
            if sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty:
                _apply_penalties(logits[i], r)

        dead = _dead_rows(logits, grammar) if grammar is not None else []
        greedy = [i for i, r in enumerate(reqs) if r.sampling.greedy]
        tokens = torch.empty(n, dtype=torch.long)
        if len(greedy) == n:
            tokens = argmax_rows(logits)
        else:
            if greedy:
                tokens[greedy] = argmax_rows(logits[greedy])
            rand = [i for i in range(n) if not reqs[i].sampling.greedy]
            tokens[rand] = self._draw(logits[rand], [reqs[i] for i in rand])
        token_list: list[int] = tokens.tolist()
        for i in dead:
            token_list[i] = -1

        out_lp: list[TokenLogprobs | None] = [None] * n
        if raw_logprobs is not None:
            for j, i in enumerate(lp_rows):
                k = reqs[i].sampling.logprobs or 0
                row = raw_logprobs[j]
                top = torch.topk(row, k) if k else None
                out_lp[i] = TokenLogprobs(
                    float(row[token_list[i]]),
                    top.indices.tolist() if top is not None else [],
                    top.values.tolist() if top is not None else [],
                )
        return token_list, out_lp

    def _draw(self, logits: Tensor, reqs: list[SampleRow]) -> Tensor:
        """Random rows: temperature, top-k, top-p, min-p, then the exponential race."""
        m, vocab = logits.shape
        temps = torch.tensor([r.sampling.temperature for r in reqs], dtype=logits.dtype)
        x = logits.div_(temps[:, None])

        k_rows = [i for i, r in enumerate(reqs) if 0 < r.sampling.top_k < vocab]
        if k_rows:
            ks = torch.tensor([reqs[i].sampling.top_k for i in k_rows])
            sub = x[k_rows]  # [K, V] (a copy: advanced indexing)
            top = torch.topk(sub, int(ks.max()), dim=-1).values
            kth = top.gather(1, (ks - 1)[:, None])  # [K, 1]
            x[k_rows] = sub.masked_fill(sub < kth, float("-inf"))

        p_rows = [i for i, r in enumerate(reqs) if r.sampling.top_p < 1.0]
        if p_rows:
            ps = torch.tensor([reqs[i].sampling.top_p for i in p_rows], dtype=x.dtype)
            sub = x[p_rows]
            sorted_x, order = sub.sort(dim=-1, descending=True)
            p_sorted = sorted_x.softmax(dim=-1)
            # drop a token when the mass before it already reaches top_p (keeps >= 1)
            drop_sorted = (p_sorted.cumsum(dim=-1) - p_sorted) >= ps[:, None]
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            x[p_rows] = sub.masked_fill(drop, float("-inf"))

        probs = x.softmax(dim=-1)
        minp_rows = [i for i, r in enumerate(reqs) if r.sampling.min_p > 0.0]
        if minp_rows:
            mp = torch.tensor([reqs[i].sampling.min_p for i in minp_rows], dtype=probs.dtype)
            sub = probs[minp_rows]
            sub = sub.masked_fill(sub < mp[:, None] * sub.max(dim=-1, keepdim=True).values, 0.0)
            probs[minp_rows] = sub

        noise = torch.empty(m, vocab, dtype=probs.dtype)
        for i, r in enumerate(reqs):
            seed = r.sampling.seed
            if seed is None:
                noise[i].exponential_(generator=self.generator)
            else:
                self._row_gen.manual_seed(_mix(seed, r.num_output_tokens))
                noise[i].exponential_(generator=self._row_gen)
        return argmax_rows(probs.div_(noise))


def _argmax_only(r: SampleRow) -> bool:
    """Whether row ``r``'s token is its logits' argmax and nothing else: greedy, no
    logprobs, bias or penalties, and past ``min_tokens`` (nothing banned)."""
    sp = r.sampling
    return (
        sp.greedy
        and sp.logprobs is None
        and not sp.logit_bias
        and r.num_output_tokens >= sp.min_tokens
        and sp.repetition_penalty == 1.0
        and not sp.presence_penalty
        and not sp.frequency_penalty
    )


# Chunk widths for argmax_rows, widest first: the first that divides the vocabulary.
_ARGMAX_CHUNKS = (256, 128, 64, 32)


def argmax_rows(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` for ``x: [N, V]``: each row's first index of its maximum (a
    NaN counts as the maximum, as in torch), ``[N]`` int64.

    On CPU, torch's argmax is a scalar loop: 2.1 ms for ``[16, 49152]`` float32 on a
    2-vCPU Zen 3, against 0.12 ms for ``amax``, which is vectorised (per decode step of
    16 sequences that was 3% of the step). So a row is cut into ``C`` chunks of ``W``:
    ``amax`` per chunk ``[N, C]``, the first chunk holding the row's maximum (a small
    argmax), then the first position of it within that chunk ``[N, W]``. ``amax``
    propagates NaN, so the first chunk with a NaN wins, as in torch. Exact: same
    indices as ``x.argmax(dim=-1)``. Other devices, short rows and vocabularies no
    chunk width divides go to torch."""
    n, v = x.shape
    width = next((w for w in _ARGMAX_CHUNKS if v % w == 0), 0)
    if x.device.type != "cpu" or not width or v < 4 * width or n == 0:
        return x.argmax(dim=-1)
    chunks = x.unflatten(1, (v // width, width))  # [N, C, W], a view
    best = chunks.amax(dim=-1).argmax(dim=-1)  # [N]: the first chunk holding the max
    rows = torch.arange(n)
    within = chunks[rows, best].argmax(dim=-1)  # [N, W] -> [N]
    return best * width + within


def _dead_rows(logits: Tensor, grammar: GrammarMask) -> list[int]:
    """Constrained rows with no finite logit left (the grammar and ``min_tokens`` banned
    everything). They are zeroed so the draw stays NaN-free; their token is discarded."""
    rows = torch.tensor(grammar.rows, dtype=torch.long)
    alive = torch.isfinite(logits.amax(dim=-1)[rows])  # a max per row, no [R, V] copy
    if bool(alive.all()):
        return []
    dead = rows[~alive].tolist()
    logits[dead] = 0.0
    return dead


def _sanitise(logits: Tensor) -> Tensor:
    """NaN -> -inf, +inf -> the largest float; a row left with no finite value becomes
    uniform, so one broken row cannot take the batch down."""
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    dead = ~torch.isfinite(logits).any(dim=-1)
    if bool(dead.any()):
        logits[dead] = 0.0
    return logits


def _apply_logit_bias(logits: Tensor, rows: list[int], reqs: Sequence[SampleRow]) -> None:
    """In place on ``logits [N, V]``: ``logits[i, t] += bias`` for each ``(t, bias)`` in
    the ``logit_bias`` of ``reqs[i]``, ``i`` in ``rows``, in one indexed add. Ids beyond
    the vocabulary are skipped (the engine refuses them before they get here)."""
    vocab = logits.shape[1]
    row_idx: list[int] = []
    col_idx: list[int] = []
    vals: list[float] = []
    for i in rows:
        for t, b in (reqs[i].sampling.logit_bias or {}).items():
            if t < vocab:
                row_idx.append(i)
                col_idx.append(t)
                vals.append(b)
    index = (torch.tensor(row_idx, dtype=torch.long), torch.tensor(col_idx, dtype=torch.long))
    logits.index_put_(index, torch.tensor(vals, dtype=logits.dtype), accumulate=True)


def _apply_penalties(row: Tensor, req: SampleRow) -> None:
    """In place on one row ``[V]``. Repetition: prompt and output tokens (divide positive
    logits, multiply negative ones). Presence/frequency: output tokens only."""
    sp, vocab = req.sampling, row.shape[0]
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in req.token_ids if t < vocab}), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(
            vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty
        )
    if (sp.presence_penalty or sp.frequency_penalty) and req.num_output_tokens:
        out = torch.tensor([t for t in req.output_token_ids if t < vocab], dtype=torch.long)
        counts = torch.bincount(out, minlength=vocab).to(row.dtype)
        row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)
