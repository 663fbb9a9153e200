"""Speculative decoding on the real default model, default format (GGUF blocks, whose
kernels are batch-invariant): with n-gram drafts the output is token for token the
plain output, greedy and seeded with penalties, logprobs included, structured output
too, and an input-grounded prompt really accepts drafts. One engine serves both arms
(the drafter is switched on and off), so nothing but the drafts differs."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from structllm import LLM, SamplingParams
from structllm.config import SpeculativeConfig
from structllm.engine.speculative import Drafter
from structllm.protocol import StructuredOutputs

pytestmark = pytest.mark.slow

RECORD = json.dumps(
    {"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"], "id": "A-17"}
)
CHATS = [
    [{"role": "user", "content": f"Repeat this JSON exactly:\n{RECORD}"}],  # input-grounded
    [{"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Count from one to ten in words, separated by commas."}],
    [{"role": "user", "content": "Write one sentence about the moon."}],
]


@pytest.fixture(scope="module")
def default_llm() -> Iterator[LLM]:
    with LLM(max_num_seqs=8) as llm:
        yield llm


def both(llm: LLM, prompts: list, sps: list[SamplingParams], k: int = 4) -> tuple:  # type: ignore[type-arg]
    def run() -> list[tuple]:  # type: ignore[type-arg]
        res = llm.chat(prompts, sps)
        return [(o.token_ids, o.text, o.finish_reason, o.logprobs) for r in res for o in r.outputs]

    llm.engine.scheduler.drafter = None
    plain = run()
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=k))
    llm.engine.scheduler.drafter = drafter
    try:
        spec = run()
    finally:
        llm.engine.scheduler.drafter = None
    return plain, spec, drafter.stats


def test_greedy_equal_and_grounded_prompt_accepts(default_llm: LLM) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)
    plain, spec, stats = both(default_llm, CHATS, [sp] * len(CHATS))
    assert spec == plain
    assert stats.num_accepted_tokens >= 10, "the JSON echo should accept drafts"
    # fewer model rows were sampled one by one: accepted drafts are tokens for free
    assert stats.num_accepted_tokens <= stats.num_draft_tokens


def test_seeded_sampling_with_penalties_equal(default_llm: LLM) -> None:
    sp = SamplingParams(
        temperature=0.8,
        top_p=0.95,
        top_k=50,
        seed=5,
        max_tokens=32,
        logprobs=3,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
    )
    plain, spec, stats = both(default_llm, CHATS, [sp] * len(CHATS))
    assert spec == plain
    assert stats.num_drafts > 0


def test_structured_output_equal(default_llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
        "required": ["name", "born"],
    }
    sp = SamplingParams(
        temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputs(json=schema)
    )
    plain, spec, _ = both(default_llm, CHATS[:2], [sp] * 2)
    assert spec == plain
    for _tokens, text, reason, _ in spec:
        assert reason == "stop"
        assert set(json.loads(text)) >= {"name", "born"}
