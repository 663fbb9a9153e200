"""Speculative decoding on the real default model, default format (GGUF blocks, whose
kernels are batch-invariant): with n-gram drafts the output is token for token the
plain output, greedy over 30 prompts (input-grounded and open) at concurrency 1 and 4 and
seeded with penalties, logprobs included, structured output too, and the input-grounded
prompts really accept drafts. One engine serves both arms
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


CODE = """def merge(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]
"""
DOC = (
    "Shipping policy. Orders placed before 2 pm ship the same day. Orders over 50 euros "
    "ship free within the EU. Returns are accepted within 30 days if the item is unused. "
    "Refunds go back to the original payment method within 5 business days. Gift cards "
    "cannot be returned. Contact support at help@example.com for damaged items."
)
GROUNDED = [  # the output repeats, edits or extracts from the input: drafts get accepted
    f"Repeat this JSON exactly:\n{RECORD}",
    f"Repeat this code exactly:\n{CODE}",
    f"Rename the function merge to merge_sorted and return the whole code:\n{CODE}",
    f"Copy the first two sentences of this text word for word:\n{DOC}",
    f"From the text below, quote the sentence about refunds.\n\n{DOC}",
    f"Rewrite this text with 'euros' replaced by 'EUR':\n{DOC}",
    f"Return this JSON with the id changed to B-42:\n{RECORD}",
    "Repeat after me: the quick brown fox jumps over the lazy dog, "
    "the quick brown fox jumps over the lazy dog.",
    "List the words of this sentence one per line: red green blue yellow orange purple.",
    "Count from one to ten in words, separated by commas.",
]
OPEN = [  # open chat: few drafts, mostly rejected
    "Name three colours.",
    "Write one sentence about the moon.",
    "What is the capital of France?",
    "Give me a haiku about rain.",
    "Why do cats purr?",
    "Suggest a name for a small bakery.",
    "What is 12 times 7?",
    "Explain photosynthesis in one sentence.",
    "Tell me a fun fact about octopuses.",
    "What should I eat for breakfast?",
    "Describe the colour blue to a child.",
    "How do I boil an egg?",
    "Write a two-line poem about winter.",
    "What is a prime number?",
    "Give one tip for learning a language.",
    "Who wrote Romeo and Juliet?",
    "What does a compiler do?",
    "Name a planet with rings.",
    "Say hello in three languages.",
    "Why is the sea salty?",
]
PROMPTS = GROUNDED + OPEN  # 30


def test_greedy_equal_on_30_prompts_at_concurrency_1_and_4(default_llm: LLM) -> None:
    """Greedy, logprobs on: token for token and logprob for logprob the plain output,
    each prompt at concurrency 4 (in groups of 4) and three grounded ones at concurrency 1;
    grounded prompts really accept drafts."""
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)

    def run() -> list[tuple]:  # type: ignore[type-arg]
        outs = []
        fours = [chats[i : i + 4] for i in range(0, len(chats), 4)]  # concurrency 4
        ones = [[c] for c in chats[:3]]  # concurrency 1
        for groups in (fours, ones):
            for group in groups:
                res = default_llm.chat(group, [sp] * len(group))
                outs += [(o.token_ids, o.finish_reason, o.logprobs) for r in res for o in r.outputs]
        return outs

    default_llm.engine.set_speculative(None)
    plain = run()
    default_llm.engine.set_speculative(
        SpeculativeConfig(num_speculative_tokens=4, max_step_tokens=256)
    )
    drafter = default_llm.engine.scheduler.drafter
    assert drafter is not None
    try:
        spec = run()
    finally:
        default_llm.engine.set_speculative(None)
    assert len(plain) == len(PROMPTS) + 3
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert b == a, f"output {i} differs with drafts"
    stats = drafter.stats
    assert stats.num_accepted_tokens >= 40, "the grounded prompts should accept drafts"
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


def test_default_adaptive_drafts_equal_on_grounded_prompts(default_llm: LLM) -> None:
    """The default drafter (n-gram, each request's length from its acceptance and the
    step cost table, up to 8 rows) on the grounded prompts one at a time and then all
    at once: greedy output and logprobs are the plain ones, and long chunks ran."""
    chats = [[{"role": "user", "content": p}] for p in GROUNDED]
    sp = SamplingParams(temperature=0.0, max_tokens=32, logprobs=1)

    def run() -> list[tuple]:  # type: ignore[type-arg]
        outs = []
        for group in [[c] for c in chats] + [chats]:
            res = default_llm.chat(group, [sp] * len(group))
            outs += [(o.token_ids, o.finish_reason, o.logprobs) for r in res for o in r.outputs]
        return outs

    default_llm.engine.set_speculative(None)
    plain = run()
    default_llm.engine.set_speculative(SpeculativeConfig())
    drafter = default_llm.engine.scheduler.drafter
    assert drafter is not None and drafter.step_cost is not None
    try:
        spec = run()
    finally:
        default_llm.engine.set_speculative(None)
    assert spec == plain
    assert drafter.stats.accepted_per_pos[4] > 0  # chunks past 4 drafts were accepted
