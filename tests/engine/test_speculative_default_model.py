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

    llm.engine.set_speculative(None)
    plain = run()
    # drafts in batches too (no max_step_tokens cap): every row count is exercised
    llm.engine.set_speculative(SpeculativeConfig(num_speculative_tokens=k, max_step_tokens=256))
    drafter = llm.engine.scheduler.drafter
    assert drafter is not None
    try:
        spec = run()
    finally:
        llm.engine.set_speculative(None)
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


def test_tool_calls_and_n_2_equal(default_llm: LLM) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    chat = [{"role": "user", "content": "What is the weather in Paris? Paris, Paris."}]
    sp = SamplingParams(temperature=0.0, max_tokens=48)

    def run() -> list[tuple]:  # type: ignore[type-arg]
        res = default_llm.chat(chat, sp, tools=tools, tool_choice="required")
        return [  # (a call's id is random)
            (o.token_ids, o.text, o.finish_reason, [(c.name, c.arguments) for c in o.tool_calls])
            for o in res[0].outputs
        ]

    default_llm.engine.set_speculative(None)
    plain = run()
    default_llm.engine.set_speculative(SpeculativeConfig(max_step_tokens=256))
    try:
        spec = run()
    finally:
        default_llm.engine.set_speculative(None)
    assert spec == plain
    assert plain[0][2] == "tool_calls" and plain[0][3]
    # n = 2, seeded: each choice as without drafts
    sp2 = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=24)
    plain2, spec2, stats = both(default_llm, CHATS[:1], [sp2])
    assert spec2 == plain2 and len(spec2) == 2
    assert stats.num_drafts > 0
