"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end on CPU.

Reference: transformers' own float32 model built from the same GGUF file, generating
each prompt alone. Our engine generates all prompts together, continuously batched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from structllm import LLM, SamplingParams
from tests.support.models import EXACT, hf_greedy_along, hf_logits, prefill_logits

pytestmark = pytest.mark.slow

N_NEW = 32
LONG = (
    "The history of computing is a story of abstraction layered on abstraction. "
    "Early machines were programmed by rewiring, then by punched cards, then by assembly, "
    "and finally by high-level languages that let people think about problems "
    "rather than circuits. "
) * 4
MESSAGES: list[Any] = [
    "Hello, my name is",
    "The capital city of France is",
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colors."},
    ],
    "def fibonacci(n):\n    ",
    LONG + "In summary,",
    [{"role": "user", "content": "Write a haiku about the sea. " * 3}],
    "1, 2, 3, 4,",
]
GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW)


@pytest.fixture(scope="module")
def prompt_ids(llm: LLM) -> list[list[int]]:
    ids = [llm._encode(m) for m in MESSAGES]
    assert len({len(i) for i in ids}) == len(ids), "prompts should have different lengths"
    return ids


@pytest.fixture(scope="module")
def batched(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    llm.engine.kv.reset_prefix_cache()
    return [o.token_ids for o in llm.generate(prompt_ids, GREEDY)]


def test_batched_greedy_matches_transformers(
    hf_model: Any, prompt_ids: list[list[int]], batched: list[list[int]]
) -> None:
    # transformers' greedy choice at every step, each prompt alone (one teacher-forced
    # pass along our tokens: the same tokens as its generate(), see hf_greedy_along)
    for ids, got in zip(prompt_ids, batched, strict=True):
        assert got == hf_greedy_along(hf_model, ids, got, N_NEW)


def test_prefill_logits_match_transformers(
    llm: LLM, hf_model: Any, prompt_ids: list[list[int]]
) -> None:
    for ids in prompt_ids:
        ours, theirs = prefill_logits(llm.engine, ids), hf_logits(hf_model, ids)
        assert (ours - theirs).abs().max().item() < 1e-3


def test_chunked_prefill_gives_the_same_tokens(
    prompt_ids: list[list[int]], batched: list[list[int]]
) -> None:
    small = LLM(max_num_batched_tokens=16, kv_cache_memory=128 << 20, **EXACT)
    outs = small.generate(prompt_ids, GREEDY)
    assert [o.token_ids for o in outs] == batched


def test_preemption_gives_the_same_tokens(
    prompt_ids: list[list[int]], batched: list[list[int]]
) -> None:
    longest = max(len(i) for i in prompt_ids) + N_NEW
    block_bytes = 16 * 2 * 30 * 3 * 64 * 4  # tokens x (K,V) x layers x kv heads x head dim x f32
    blocks = -(-longest // 16) + 4  # the longest request alone fits; all eight together cannot
    tight = LLM(kv_cache_memory=blocks * block_bytes, enable_prefix_caching=False, **EXACT)
    outs = tight.generate(prompt_ids, GREEDY)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == batched
    assert tight.engine.kv.num_free_blocks == tight.engine.kv.num_blocks


def test_shared_prefix_is_served_from_the_cache(llm: LLM) -> None:
    llm.engine.kv.reset_prefix_cache()
    questions = ["What is computing?", "Who invented assembly?", "Why abstraction?"]
    chats = [
        [{"role": "system", "content": LONG}, {"role": "user", "content": q}] for q in questions
    ]
    first = llm.generate(chats[:1], GREEDY)[0]
    rest = llm.generate(chats[1:], GREEDY)
    assert first.num_cached_tokens == 0
    prefix_len = len(llm.tokenizer.encode_chat(chats[0][:1], add_generation_prompt=False))
    for out in rest:
        assert out.num_cached_tokens >= (prefix_len // 16) * 16 > 100
    uncached = LLM(enable_prefix_caching=False, kv_cache_memory=64 << 20, **EXACT).generate(
        chats[1:], GREEDY
    )
    assert [o.token_ids for o in rest] == [o.token_ids for o in uncached]
    assert all(o.num_cached_tokens == 0 for o in uncached)


def test_seeded_sampling_is_reproducible_alone_and_in_a_mixed_batch(
    llm: LLM, prompt_ids: list[list[int]]
) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    alone = llm.generate([prompt_ids[0]], seeded)[0].token_ids
    again = llm.generate([prompt_ids[0]], seeded)[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=30),
        GREEDY,
        SamplingParams(temperature=0.7, seed=9, max_tokens=8),
    ]
    mixed = llm.generate(
        [prompt_ids[3], prompt_ids[0], prompt_ids[5], prompt_ids[1]],
        [others[0], seeded, others[1], others[2]],
    )
    assert alone == again == mixed[1].token_ids
    unseeded = {
        tuple(
            llm.generate([prompt_ids[0]], SamplingParams(temperature=0.9, max_tokens=24))[
                0
            ].token_ids
        )
        for _ in range(3)
    }
    assert len(unseeded) > 1


def test_stop_string_ends_the_request_in_the_engine(llm: LLM) -> None:
    full = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20))[0]
    assert " 7," in full.text
    cut = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop=[" 7"]))[0]
    assert cut.text == full.text[: full.text.index(" 7")]
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == " 7"
    assert llm.engine.scheduler.requests == {} and not llm.engine.has_work


def test_logprobs_are_returned_per_token(llm: LLM) -> None:
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=5, logprobs=3)
    )[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.top_ids[0] == tok  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top_logprobs[0]) and lp.logprob <= 0
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


def test_kv_usage_returns_to_zero(llm: LLM, prompt_ids: list[list[int]]) -> None:
    llm.generate(prompt_ids, SamplingParams(temperature=0.5, max_tokens=8, n=2))
    assert llm.engine.kv.usage == 0.0
    assert torch.get_num_threads() >= 1
