"""The last pipeline stage samples every row (``engine.stage_sampling``): from what the
steps carry (settings once, token ids once, masks, output indices), its ``Sampler``
picks the tokens and logprobs rank 0's would, row for row, over several steps."""

from __future__ import annotations

import msgspec
import torch

from structllm.engine.grammar import GrammarMask
from structllm.engine.request import Request, Status
from structllm.engine.sampler import Sampler
from structllm.engine.speculative import DraftRow, SampleRow
from structllm.engine.stage_sampling import StageFeed, StageSampler, packed_size, unpack
from structllm.protocol import SamplingParams, StepInput

V = 300


def req(rid: str, prompt: list[int], **sp: object) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=100, **sp), 100)  # type: ignore[arg-type]


def wire(step: StepInput) -> StepInput:
    """Through msgpack, as the broadcast ring carries it."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(step), type=StepInput)


def step_of(feed: StageFeed, rows: list[SampleRow], mask: GrammarMask | None) -> StepInput:
    out, released, whole = feed.rows(rows, mask)
    step = StepInput(
        bytearray(), bytearray(), bytearray(), bytearray(), [], [0], 0, [],
        last_stage_rows=out, released=released, rank0_samples=not whole,
    )  # fmt: skip
    return wire(step)


def test_the_last_stage_samples_what_rank_0_would() -> None:
    reqs = [
        req("greedy", [1, 2, 3], temperature=0.0),
        req("seeded", [4, 5], temperature=0.7, top_p=0.8, seed=3, logprobs=3),
        req("unseeded", [6], temperature=1.3, top_k=20, min_p=0.05),
        req("penalised", [7, 7, 8], repetition_penalty=1.3, frequency_penalty=0.8,
            temperature=0.0, presence_penalty=0.5),
        req("biased", [9], logit_bias={11: 30.0, 12: -100.0}, temperature=0.0, logprobs=0),
        req("min_tokens", [10], min_tokens=3, stop_token_ids=[13], temperature=0.0),
        req("constrained", [2], temperature=0.5, seed=9, logprobs=2),
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    rank0, last = Sampler([0, 13], seed=4), StageSampler(Sampler([0, 13], seed=4))
    feed = StageFeed(budget=1 << 16)
    total = 0
    for step_no in range(6):
        live = [q for q in reqs if q.status is not Status.FINISHED]
        rows: list[SampleRow] = list(live)
        if step_no == 2:  # a verified chunk: the penalised request with two drafts
            p = reqs[3]
            rows = [*rows, DraftRow(p, [21]), DraftRow(p, [21, 22])]
        logits = torch.randn(len(rows), V, generator=gen) * 3
        logits[:, 0] += 5.0  # EOS likely: min_tokens must ban it
        for i, q in enumerate(rows):  # the penalties decide: seen ids lead unless penalised
            if q.sampling.repetition_penalty != 1.0:
                logits[i] = torch.randn(V, generator=gen) * 0.1
                logits[i, q.token_ids] = 2.0
                logits[i, 100 + step_no] = 1.8
        c = next(i for i, q in enumerate(rows) if q is reqs[-1])
        bits = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
        bits[0, 1] = 0b1011 << step_no  # a few allowed ids from 32 on
        mask = GrammarMask([c], bits)
        want = rank0(logits.clone(), rows, mask)
        step = step_of(feed, rows, mask)
        assert not step.rank0_samples and step.last_stage_rows is not None
        last.release(step.released)
        last.ingest(step.last_stage_rows)
        msg = last.sample(logits.clone(), step.last_stage_rows)
        assert msg.shape == (packed_size(rows),)
        assert unpack(msg, rows) == want
        total += len(set(want[0]))
        for q, t in zip(live, want[0], strict=False):  # (the draft rows come last)
            q.token_ids.append(t)
        if step_no == 3:  # one ends: released with the next step
            reqs[1].status = Status.FINISHED
    assert last.num_held == len(reqs) - 1
    assert total > 12  # not one token everywhere
    assert reqs[3].output_token_ids[:2] == [100, 101]  # (the penalties acted)


def test_a_step_over_the_budget_is_sampled_on_rank_0_until_the_history_is_there() -> None:
    long = [req(f"p{i}", list(range(1, 200)), repetition_penalty=1.2) for i in range(3)]
    feed = StageFeed(budget=1000)  # ~250 token ids a step
    last = StageSampler(Sampler([0], seed=0))
    steps = []
    while True:
        step = step_of(feed, list(long), None)
        assert step.last_stage_rows is not None
        last.ingest(step.last_stage_rows)
        steps.append(step.rank0_samples)
        if not step.rank0_samples:
            break
    assert steps == [True, True, True, False]  # 597 ids + settings at ~250 a step
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    want = Sampler([0], seed=0)(logits.clone(), long)
    assert unpack(last.sample(logits.clone(), step.last_stage_rows), long) == want
