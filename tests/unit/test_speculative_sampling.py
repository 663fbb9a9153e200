"""The acceptance rule's distribution: drafted rows sampled by the real ``Sampler`` (as
``DraftRow``s) and walked by ``speculative.accept`` emit token sequences with exactly
the probabilities of sampling them one step at a time. Chi-square over a toy
vocabulary, many draws (the sampler's generator is seeded, so the test is
deterministic)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from structllm.engine.request import Request
from structllm.engine.sampler import Sampler
from structllm.engine.speculative import DraftRow, SampleRow, accept
from structllm.protocol import SamplingParams

V = 5
HISTORY = [1, 4]
TRIALS = 3000  # drafted chunks
BATCH = 1000  # chunks per sampler call


def toy_logits(history: list[int]) -> torch.Tensor:
    """A fixed function of the history: each position's distribution differs."""
    g = torch.Generator().manual_seed(hash(tuple(history)) % (1 << 31))
    return torch.randn(V, generator=g) * 1.2


def _likely_drafts() -> list[int]:
    """Each position's most likely token (so top-k keeps it and it is often accepted)."""
    drafts: list[int] = []
    for _ in range(2):
        drafts.append(int(toy_logits(HISTORY + drafts).argmax()))
    return drafts


DRAFTS = _likely_drafts()


def probs(history: list[int], sp: SamplingParams) -> torch.Tensor:
    """What one plain step samples from: temperature then top-k."""
    x = toy_logits(history) / sp.temperature
    if sp.top_k:
        kth = x.topk(sp.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    return x.softmax(-1)


def expected(sp: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(emitted sequence) under step-by-step sampling: tokens match the drafts up to a
    point, then the first different token (or the one after the last draft)."""
    out: dict[tuple[int, ...], float] = {}
    prefix: list[int] = []
    mass = 1.0
    for j in range(len(DRAFTS) + 1):
        p = probs(HISTORY + prefix, sp)
        for t in range(V):
            if j == len(DRAFTS) or t != DRAFTS[j]:
                out[(*prefix, t)] = mass * float(p[t])
        if j < len(DRAFTS):
            mass *= float(p[DRAFTS[j]])
            prefix.append(DRAFTS[j])
    return out


def draw(sp: SamplingParams, shuffle_rows: bool = False) -> Counter[tuple[int, ...]]:
    sampler = Sampler([V + 1], seed=1234)  # EOS outside the toy vocabulary
    req = Request("r", HISTORY[:1], sp, 100)
    req.token_ids += HISTORY[1:]
    rows: list[SampleRow] = [DraftRow(req, DRAFTS[:j]) for j in range(len(DRAFTS) + 1)]
    one = torch.stack([toy_logits(HISTORY + DRAFTS[:j]) for j in range(len(DRAFTS) + 1)])
    if shuffle_rows:  # a broken verifier: each row scored with the wrong position's logits
        one = one.flip(0)
    counts: Counter[tuple[int, ...]] = Counter()
    k = len(rows)
    for _ in range(TRIALS // BATCH):
        tokens, _ = sampler(one.repeat(BATCH, 1), rows * BATCH)
        for b in range(BATCH):
            counts[tuple(accept(tokens[b * k : (b + 1) * k], DRAFTS))] += 1
    return counts


def chi_square(counts: Counter[tuple[int, ...]], want: dict[tuple[int, ...], float]) -> float:
    n = sum(counts.values())
    if not set(counts) <= {o for o, p in want.items() if p > 0}:
        return math.inf  # a sequence plain sampling can never emit
    return sum((counts[o] - n * p) ** 2 / (n * p) for o, p in want.items() if p > 0)


def critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at upper tail 1e-4 (z of the normal), Wilson-Hilferty."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=3),
    ],
)
def test_emitted_sequences_have_plain_sampling_probabilities(sp: SamplingParams) -> None:
    want = expected(sp)
    assert sum(want.values()) == pytest.approx(1.0)
    df = sum(p > 0 for p in want.values()) - 1
    counts = draw(sp)
    # the drafts are accepted at their plain probability, row by row
    assert counts[(*DRAFTS, 0)] + sum(counts[(*DRAFTS, t)] for t in range(1, V)) > 0
    assert chi_square(counts, want) < critical(df)
    # and the test has the power to see a verifier that scores the wrong rows
    assert chi_square(draw(sp, shuffle_rows=True), want) > critical(df)


def test_seeded_rows_draw_as_the_output_index_they_stand_for() -> None:
    """A seeded request's row after ``j`` drafts draws what plain decoding draws for
    output index ``num_output_tokens + j``: same token, row for row."""
    sp = SamplingParams(temperature=1.0, seed=77)
    req = Request("r", [1], sp, 100)
    req.token_ids += [4, 2]
    logits = torch.stack([toy_logits([9])] * 3)
    drafted = Sampler([V + 1])(logits.clone(), [DraftRow(req, [3] * j) for j in range(3)])[0]
    plain = []
    for j in range(3):
        step = Request("p", [1], sp, 100)
        step.token_ids += [4, 2] + [3] * j
        plain += Sampler([V + 1])(logits[j : j + 1].clone(), [step])[0]
    assert drafted == plain
