"""Prompt logprobs (``SamplingParams.prompt_logprobs``) and ``max_tokens=0``.

The scheduler-level tests use the null runner, whose fake scores name the scored token
as the first alternative, to check which positions are sent and when. The real-model
tests compare with transformers' float32 log-softmax of the same prompt, through a
whole prefill, chunked prefill, a prefix-cache hit and preemption.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import structllm.engine.runner
from structllm import LLM, SamplingParams
from structllm.engine.kv_cache import KVCacheManager
from structllm.engine.null import NullRunner
from structllm.engine.request import Request
from structllm.engine.scheduler import Scheduler
from structllm.protocol import TokenDelta, TokenLogprobs
from tests.support.models import hf_logits

# -- scheduling, with the null runner ---------------------------------------------------


def run_null(
    reqs: list[Request], num_blocks: int = 64, budget: int = 2048, prefix: bool = True
) -> tuple[dict[str, list[TokenDelta]], Scheduler]:
    kv = KVCacheManager(num_blocks, 4, prefix)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget)
    for r in reqs:
        sched.add_request(r)
    runner = NullRunner()
    out: dict[str, list[TokenDelta]] = {r.request_id: [] for r in reqs}
    while sched.has_work:
        step = sched.schedule()
        sampled, lps, plps = runner.execute(step)
        for d in sched.update(step, sampled, lps, plps):
            out[d.request_id].append(d)
    return out, sched


def scored(deltas: list[TokenDelta]) -> list[TokenLogprobs]:
    return [e for d in deltas for e in d.prompt_logprobs or []]


def req(rid: str, prompt: list[int], max_tokens: int = 3, **sp: Any) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sp), max_tokens)


@pytest.mark.parametrize("budget", [2048, 5, 1])
def test_each_prompt_position_is_scored_once_in_order(budget: int) -> None:
    prompt = list(range(10, 33))
    out, _ = run_null([req("a", prompt, prompt_logprobs=2)], budget=budget)
    entries = scored(out["a"])
    assert [e.top_ids[0] for e in entries] == prompt[1:]  # entry k scores prompt token k+1
    assert all(len(e.top_ids) == 2 for e in entries)
    assert sum(len(d.new_token_ids) for d in out["a"]) == 3
    if budget < len(prompt):  # chunks that do not sample still send their scores
        assert sum(1 for d in out["a"] if d.prompt_logprobs and not d.new_token_ids) > 1


def test_requests_without_prompt_logprobs_get_none() -> None:
    out, _ = run_null([req("a", list(range(10, 30)))], budget=4)
    assert all(d.prompt_logprobs is None and d.new_token_ids for d in out["a"])


def test_max_tokens_zero_finishes_after_the_prefill() -> None:
    prompt = list(range(10, 30))
    out, sched = run_null([req("a", prompt, 0, prompt_logprobs=0), req("b", prompt, 0)], budget=7)
    for rid in "ab":
        assert [t for d in out[rid] for t in d.new_token_ids] == []
        assert out[rid][-1].finish_reason == "length"
        assert sum(d.finish_reason is not None for d in out[rid]) == 1
    assert [e.top_ids for e in scored(out["a"])] == [[]] * (len(prompt) - 1)
    assert sched.num_generation_tokens == 0


def test_prompt_logprobs_skip_the_prefix_cache_but_fill_it() -> None:
    prompt = list(range(10, 30))
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, 8, 2048)
    runner = NullRunner()

    def run(r: Request) -> list[TokenDelta]:
        sched.add_request(r)
        got: list[TokenDelta] = []
        while sched.has_work:
            step = sched.schedule()
            got += sched.update(step, *runner.execute(step))
        return got

    run(req("warm", prompt))
    scoring = run(req("s", prompt, prompt_logprobs=1))
    assert scoring[-1].num_cached_tokens == 0 and len(scored(scoring)) == len(prompt) - 1
    kv.reset_prefix_cache()
    run(req("s2", prompt, prompt_logprobs=1))
    assert run(req("after", prompt))[-1].num_cached_tokens == 16  # s2's blocks were cached


def test_preemption_does_not_resend_scores() -> None:
    prompts = [list(range(10 + i, 30 + i)) for i in range(4)]
    reqs = [req(f"r{i}", p, 12, prompt_logprobs=1) for i, p in enumerate(prompts)]
    out, sched = run_null(reqs, num_blocks=14, budget=6)
    assert sched.num_preemptions > 0
    for r, p in zip(reqs, prompts, strict=True):
        assert [e.top_ids[0] for e in scored(out[r.request_id])] == p[1:]
        assert sum(len(d.new_token_ids) for d in out[r.request_id]) == 12


# -- the real model ---------------------------------------------------------------------

PROMPTS = [
    "The capital city of France is Paris, and the capital city of Germany is Berlin.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Once upon a time there was a little fox who lived in the forest.",
    "x",
]
TOP = 5


@pytest.fixture(scope="module")
def ids(llm: LLM) -> list[list[int]]:
    return [llm._encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(hf_model: Any, ids: list[list[int]]) -> list[torch.Tensor]:
    """transformers' log-softmax ``[P, V]`` of each prompt."""
    return [torch.log_softmax(hf_logits(hf_model, i), dim=-1) for i in ids]


def check_against(
    ref: torch.Tensor, prompt: list[int], got: list[TokenLogprobs | None] | None
) -> None:
    """``got`` (an offline ``prompt_logprobs``) against transformers' ``ref [P, V]``."""
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for k, e in enumerate(got[1:]):  # e scores prompt[k + 1] from position k
        assert e is not None
        assert abs(e.logprob - ref[k, prompt[k + 1]].item()) < 1e-4
        want_top = torch.topk(ref[k], TOP).values
        assert torch.allclose(torch.tensor(e.top_logprobs), want_top, atol=1e-4)
        assert torch.allclose(ref[k, e.top_ids], want_top, atol=1e-4)  # ids may swap on ties


@contextmanager
def engine_limits(
    llm: LLM, budget: int | None = None, num_blocks: int | None = None
) -> Iterator[None]:
    """Run ``llm`` with a smaller token budget and/or KV pool (a subset of its blocks),
    without loading another engine."""
    sched = llm.engine.scheduler
    old_budget, old_kv = sched.max_num_batched_tokens, sched.kv
    if budget is not None:
        sched.max_num_batched_tokens = budget
    if num_blocks is not None:
        sched.kv = llm.engine.kv = KVCacheManager(
            num_blocks, old_kv.block_size, old_kv.enable_prefix_caching
        )
    try:
        yield
    finally:
        sched.max_num_batched_tokens = old_budget
        sched.kv = llm.engine.kv = old_kv


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 16])
def test_prompt_logprobs_match_transformers(
    llm: LLM, ids: list[list[int]], reference: list[torch.Tensor], budget: int | None
) -> None:
    llm.engine.kv.reset_prefix_cache()
    with engine_limits(llm, budget=budget):
        outs = llm.generate(ids, SamplingParams(prompt_logprobs=TOP, max_tokens=2, temperature=0))
    for out, prompt, ref in zip(outs, ids, reference, strict=True):
        check_against(ref, prompt, out.prompt_logprobs)
        assert len(out.token_ids) == 2 and out.finish_reason == "length"


@pytest.mark.slow
def test_prompt_logprobs_with_a_cached_prefix(
    llm: LLM, ids: list[list[int]], reference: list[torch.Tensor]
) -> None:
    llm.engine.kv.reset_prefix_cache()
    prompt, ref = ids[0], reference[0]
    warm = llm.generate([prompt[:-1] + [prompt[0]]], SamplingParams(max_tokens=1))[
        0
    ]  # shares the prefix
    assert warm.num_cached_tokens == 0
    out = llm.generate([prompt], SamplingParams(prompt_logprobs=TOP, max_tokens=0))[0]
    assert out.num_cached_tokens == 0  # computed in full, cache hits notwithstanding
    check_against(ref, prompt, out.prompt_logprobs)
    again = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens > 0


@pytest.mark.slow
def test_prompt_logprobs_under_preemption(
    llm: LLM, ids: list[list[int]], reference: list[torch.Tensor]
) -> None:
    longest = max(len(i) for i in ids) + 24
    blocks = -(-longest // 16) + 2  # the longest request alone fits; all four together cannot
    llm.engine.kv.reset_prefix_cache()
    before = llm.engine.scheduler.num_preemptions
    with engine_limits(llm, budget=16, num_blocks=blocks):
        outs = llm.generate(
            ids, SamplingParams(prompt_logprobs=TOP, max_tokens=24, temperature=0, ignore_eos=True)
        )
    assert llm.engine.scheduler.num_preemptions > before
    for out, prompt, ref in zip(outs, ids, reference, strict=True):
        check_against(ref, prompt, out.prompt_logprobs)


@pytest.mark.slow
def test_max_tokens_zero_scores_the_prompt_only(llm: LLM, ids: list[list[int]]) -> None:
    out = llm.generate([ids[2]], SamplingParams(prompt_logprobs=0, max_tokens=0))[0]
    assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids[2])
    assert all(e is not None and e.top_ids == [] for e in out.prompt_logprobs[1:])
    plain = llm.generate([ids[2]], SamplingParams(max_tokens=0))[0]
    assert (
        plain.token_ids == [] and plain.prompt_logprobs is None and plain.finish_reason == "length"
    )


@pytest.mark.slow
def test_right_continuation_scores_higher(llm: LLM) -> None:
    context = llm.tokenizer.encode("The capital city of France is")
    scores = {}
    for answer in (" Paris", " Banana"):
        cont = llm.tokenizer.encode(answer, add_special_tokens=False)
        out = llm.generate([context + cont], SamplingParams(prompt_logprobs=0, max_tokens=0))[0]
        assert out.prompt_logprobs is not None
        scores[answer] = sum(
            e.logprob for e in out.prompt_logprobs[len(context) :] if e is not None
        )
    assert scores[" Paris"] > scores[" Banana"]


# -- a tiny random model: logit slices, tensor parallelism ------------------------------

TINY_PROMPTS = [list(range(100, 400)), [7, 8, 9, 10, 11], list(range(500, 900, 7)), [3]]
SCORE = SamplingParams(prompt_logprobs=3, temperature=0, max_tokens=4, ignore_eos=True)


def assert_same_scores(a: list[Any], b: list[Any], atol: float) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert len(x.prompt_logprobs) == len(y.prompt_logprobs)
        for e, f in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], strict=True):
            assert abs(e.logprob - f.logprob) < atol
            assert torch.allclose(
                torch.tensor(e.top_logprobs), torch.tensor(f.top_logprobs), atol=atol
            )


def test_tiny_model_logit_slices_and_transformers(
    tiny_llama_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 300-token prompt scored in one step spans two logit slices; slices of 3 rows
    split the sampling rows from the scored ones mid-slice. All agree with transformers."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_llama_dir), kv_cache_memory=8 << 20, dtype="float32")
    whole = llm.generate(TINY_PROMPTS, SCORE)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    for out, prompt in zip(whole, TINY_PROMPTS, strict=True):
        ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
        assert out.prompt_logprobs is not None
        got = [e.logprob for e in out.prompt_logprobs[1:] if e is not None]
        want = [ref[k, prompt[k + 1]].item() for k in range(len(prompt) - 1)]
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-4)
    monkeypatch.setattr(structllm.engine.runner, "LOGIT_SLICE", 3)
    llm.engine.kv.reset_prefix_cache()
    assert_same_scores(whole, llm.generate(TINY_PROMPTS, SCORE), atol=1e-5)


def test_tiny_model_tp_scores_like_one_process(tiny_llama_dir: Any) -> None:
    kw: dict[str, Any] = dict(kv_cache_memory=8 << 20, dtype="float32")
    ref = LLM(str(tiny_llama_dir), **kw).generate(TINY_PROMPTS, SCORE)
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, **kw) as tp:
        assert_same_scores(ref, tp.generate(TINY_PROMPTS, SCORE), atol=1e-4)
        with engine_limits(tp, budget=48):  # chunked: scores sent over several steps
            tp.engine.kv.reset_prefix_cache()
            assert_same_scores(ref, tp.generate(TINY_PROMPTS, SCORE), atol=1e-4)


def test_engine_core_max_tokens_zero_fits_a_prompt_of_max_model_len() -> None:
    """A prompt-only request needs no room for a generated token; others do."""
    from structllm.config import EngineConfig
    from structllm.engine.core import EngineCore
    from structllm.protocol import AddRequest

    core = EngineCore(EngineConfig(null_model=True, kv_cache_memory=64 << 20, max_model_len=32))
    prompt = list(range(300, 332))
    with pytest.raises(ValueError, match="max_model_len"):
        core.check_request(prompt, SamplingParams(max_tokens=1))
    core.add_request(AddRequest("a", prompt, SamplingParams(max_tokens=0, prompt_logprobs=1)))
    deltas: list[TokenDelta] = []
    while core.has_work:
        deltas += core.step().outputs
    assert [d.finish_reason for d in deltas][-1] == "length"
    assert not any(d.new_token_ids for d in deltas) and len(scored(deltas)) == 31


def test_offline_n_2_scores_the_prompt_once() -> None:
    """With ``n > 1`` the first sequence scores the prompt; the list is not doubled."""
    llm = LLM(null_model=True, kv_cache_memory=16 << 20, max_num_batched_tokens=8)
    prompt = list(range(300, 320))
    out = llm.generate([prompt], SamplingParams(n=2, prompt_logprobs=2, max_tokens=3))[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert [e.top_ids[0] for e in out.prompt_logprobs[1:] if e is not None] == prompt[1:]
    assert [len(o.token_ids) for o in out.outputs] == [3, 3]
