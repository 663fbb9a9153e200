"""Speculative decoding on a real (tiny, random-weight) model through the whole engine:
the real runner verifies each drafted chunk through paged attention and the request's
own sampler. Drafts come from an oracle that knows the plain output (so all, none or
part of them are accepted) or from the n-gram proposer. On the GGUF block format, whose
kernels give a row the same result at any row count, every output (tokens, logprobs,
text, finish reasons) must be exactly the plain run's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structllm import LLM, SamplingParams
from structllm.config import SpeculativeConfig
from structllm.engine.request import Request
from structllm.engine.speculative import MIN_MATCH, Drafter
from structllm.model.files import default_model_path
from structllm.protocol import StructuredOutputs
from tests.support.models import write_tiny_gguf

gguf = pytest.importorskip("gguf")
needs_kernels = pytest.mark.skipif(
    __import__("structllm.kernels.cpu_ext", fromlist=["x"]).best_isa() is None,
    reason="no AVX2 block kernels",
)
pytestmark = needs_kernels

QTYPES = {  # every matmul in blocks (first matching suffix wins)
    "attn_output.weight": "Q8_0",
    "token_embd.weight": "Q4_1",
    "output.weight": "Q8_0",
    "attn_q.weight": "Q4_0",
    "attn_k.weight": "Q4_0",
    "attn_v.weight": "Q4_0",
    "ffn_gate.weight": "Q4_1",
    "ffn_up.weight": "Q4_1",
    "ffn_down.weight": "Q4_1",
}
# the last prompt repeats itself, so n-gram drafts find matches
PROMPTS = [
    [1, 2, 3, 4, 5],
    list(range(100, 137)),
    [7],
    list(range(500, 700, 7)),
    [40, 41, 42, 43, 44] * 6,
]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("spec") / "tiny-blocks.gguf"
    write_tiny_gguf(path, src, default_model_path(), QTYPES)
    return path


class Oracle:
    """Drafts the plain run's continuation of the request's prompt, corrupted by
    ``mode`` ("all" right, "none" wrong, "partial" right up to a moving point)."""

    last_match = MIN_MATCH  # drafts as if from a long match

    def __init__(self, plain: dict[tuple[int, ...], list[int]], mode: str) -> None:
        self.plain, self.mode = plain, mode

    def propose(self, req: Request, k: int) -> list[int]:
        out = self.plain[tuple(req.token_ids[: req.prompt_len])]
        truth = out[req.num_output_tokens : req.num_output_tokens + k]
        wrong = [(t + 1) % 49152 for t in truth]
        if self.mode == "none":
            return wrong
        if self.mode == "partial":
            cut = req.num_tokens % (k + 1)
            return truth[:cut] + wrong[cut:]
        return truth

    def finish(self, req: Request) -> None:
        pass


def make(model: Path, spec: SpeculativeConfig | None = None, **kw: object) -> LLM:
    """An engine on ``model`` with ``spec``; without one, drafting off (on CPU blocks it
    is on by default)."""
    return LLM(
        str(model),
        quantization="gguf",
        max_num_batched_tokens=256,  # (no start-up measurement)
        speculative_config=spec or SpeculativeConfig(method="none"),
        **{"kv_cache_memory": 32 << 20, **kw},
    )


def drafting(llm: LLM, k: int, proposer: object = None) -> Drafter:
    """Give ``llm``'s engine a fresh drafter of ``k`` tokens (``proposer``: its own)."""
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=k), proposer)  # type: ignore[arg-type]
    llm.engine.scheduler.drafter = drafter
    llm.engine.scheduler.max_draft_step_tokens = None  # drafts in batches too
    return drafter


def outputs(llm: LLM, prompts: list[list[int]], sps: list[SamplingParams]) -> list[tuple]:  # type: ignore[type-arg]
    res = llm.generate(prompts, sps)
    return [
        (o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs)
        for r in res
        for o in r.outputs
    ]


SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, logprobs=3),
    "seeded": SamplingParams(
        temperature=0.9,
        top_k=40,
        top_p=0.95,
        seed=11,
        max_tokens=16,
        logprobs=2,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        logit_bias={300: 2.0},
        min_tokens=3,
    ),
}


@pytest.fixture(scope="module")
def plain_llm(tiny_gguf: Path) -> LLM:
    return make(tiny_gguf)


@pytest.fixture(scope="module")
def spec_llm(tiny_gguf: Path) -> LLM:
    return make(tiny_gguf, SpeculativeConfig())


@pytest.fixture(scope="module")
def plain_outputs(plain_llm: LLM) -> dict[str, list[tuple]]:  # type: ignore[type-arg]
    return {
        name: outputs(plain_llm, PROMPTS, [sp] * len(PROMPTS)) for name, sp in SAMPLINGS.items()
    }


@pytest.mark.parametrize(("sampling", "k"), [("greedy", 1), ("greedy", 4), ("seeded", 3)])
@pytest.mark.parametrize("mode", ["all", "none", "partial"])
def test_same_output_for_every_acceptance(
    spec_llm: LLM,
    plain_outputs: dict[str, list[tuple]],  # type: ignore[type-arg]
    sampling: str,
    mode: str,
    k: int,
) -> None:
    sp = SAMPLINGS[sampling]
    want = plain_outputs[sampling]
    plain = {tuple(p): w[0] for p, w in zip(PROMPTS, want, strict=True)}
    stats = drafting(spec_llm, k, Oracle(plain, mode)).stats
    got = outputs(spec_llm, PROMPTS, [sp] * len(PROMPTS))
    assert got == want
    assert stats.num_drafts > 0
    if mode == "all":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    elif mode == "none":
        assert stats.num_accepted_tokens == 0
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_ngram_drafts_with_stops_inside_accepted_runs(spec_llm: LLM, plain_llm: LLM) -> None:
    """The n-gram proposer on its own; stop strings, stop ids and max_tokens cut where
    plain decoding stops."""
    base = SamplingParams(temperature=0.0, max_tokens=40, logprobs=1)
    first = outputs(plain_llm, PROMPTS, [base] * len(PROMPTS))
    text = first[-1][1]
    sps = [
        base,
        SamplingParams(temperature=0.0, max_tokens=7),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[text[12:15]] if text else []),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[first[-1][0][9]]),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[text[20:22]], logprobs=2),
    ]
    prompts = [PROMPTS[-1]] * len(sps)
    want = outputs(plain_llm, prompts, sps)
    assert {w[2] for w in want} >= {"stop", "length"}
    drafter = drafting(spec_llm, 5)
    got = outputs(spec_llm, prompts, sps)
    assert drafter.stats.num_accepted_tokens > 0
    assert got == want


def test_structured_output_equal(spec_llm: LLM, plain_llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
        "required": ["a", "b"],
    }
    sps = [
        SamplingParams(
            temperature=t,
            seed=3,
            max_tokens=40,
            logprobs=1,
            structured_outputs=StructuredOutputs(json=schema),
        )
        for t in (0.0, 0.8)
    ]
    prompts = [PROMPTS[1], PROMPTS[4]]
    want = outputs(plain_llm, prompts, sps)
    plain = {tuple(p): w[0] for p, w in zip(prompts, want, strict=True)}
    for mode in ("all", "partial"):
        drafter = drafting(spec_llm, 4, Oracle(plain, mode))
        got = outputs(spec_llm, prompts, sps)
        assert drafter.stats.num_accepted_tokens > 0
        assert got == want, mode


def test_prefix_cache_never_holds_a_rejected_draft(tiny_gguf: Path, plain_llm: LLM) -> None:
    """After partial accepts and preemption (a KV pool too small for the batch), a new
    request whose prompt is an earlier prompt plus its output hits the prefix cache,
    and it still generates exactly what it generates on an engine that never ran
    drafts."""
    sp = SamplingParams(temperature=0.0, max_tokens=30)
    want = outputs(plain_llm, PROMPTS, [sp] * len(PROMPTS))
    plain = {tuple(p): w[0] for p, w in zip(PROMPTS, want, strict=True)}
    follow = [p + w[0] for p, w in zip(PROMPTS, want, strict=True)]
    follow_want = outputs(plain_llm, follow, [sp] * len(follow))
    with make(
        tiny_gguf,
        SpeculativeConfig(num_speculative_tokens=4),
        max_model_len=128,
        block_size=4,
        # 36 blocks of 4 tokens (2 layers x K,V x 2 heads x 16 x float16 = 1 KiB a block)
        # cannot hold the five requests at once: preemption
        kv_cache_memory=36 << 10,
    ) as llm:
        assert llm.engine.num_blocks == 36
        drafter = drafting(llm, 4, Oracle(plain, "partial"))
        assert drafter.stats.num_drafts == 0
        got = outputs(llm, PROMPTS, [sp] * len(PROMPTS))
        assert llm.engine.scheduler.num_preemptions > 0
        assert 0 < drafter.stats.num_accepted_tokens < drafter.stats.num_draft_tokens
        assert got == want
        llm.engine.scheduler.drafter = None  # plain decoding over the cached prefixes
        again = outputs(llm, follow, [sp] * len(follow))
        assert llm.engine.kv.num_hit_tokens > 0
    assert again == follow_want


@pytest.mark.usefixtures("no_shm_leaks")
def test_tensor_parallel_same_output(tiny_gguf: Path) -> None:
    """With two ranks the drafted chunk reaches the worker as ordinary input ids; the
    output with drafts equals the same two-rank engine's without them."""
    sp = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    with make(tiny_gguf, tensor_parallel_size=2) as tp:
        want = outputs(tp, PROMPTS, [sp] * len(PROMPTS))
        plain = {tuple(p): w[0] for p, w in zip(PROMPTS, want, strict=True)}
        drafter = drafting(tp, 3, Oracle(plain, "partial"))
        got = outputs(tp, PROMPTS, [sp] * len(PROMPTS))
        assert drafter.stats.num_accepted_tokens > 0
    assert got == want


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_adaptive_draft_length_same_output(
    name: str,
    spec_llm: LLM,
    plain_outputs: dict[str, list[tuple]],  # type: ignore[type-arg]
) -> None:
    """The engine's own drafter on CPU blocks: n-gram drafts, each request's length from
    its acceptance and the step cost table (1-7 drafts, up to 8 rows in a step; with
    five running requests none pays at the prior's acceptance, so one at a time)."""
    from structllm.engine.core import DRAFT_STEP_COST, DRAFT_STEP_ROWS

    spec_llm.engine.set_speculative(SpeculativeConfig())
    drafter = spec_llm.engine.scheduler.drafter
    assert drafter is not None and drafter.step_cost == DRAFT_STEP_COST
    assert spec_llm.engine.scheduler.max_draft_step_tokens == DRAFT_STEP_ROWS
    sp = SAMPLINGS[name]
    got = [x for p in PROMPTS for x in outputs(spec_llm, [p], [sp])]
    if name == "greedy":  # (the seeded outputs of the random model never repeat)
        assert drafter.stats.num_accepted_tokens > 0
    assert got == plain_outputs[name]
    spec_llm.engine.set_speculative(SpeculativeConfig(method="none"))  # off
    assert spec_llm.engine.scheduler.drafter is None
    assert outputs(spec_llm, PROMPTS, [sp] * len(PROMPTS)) == plain_outputs[name]


def test_on_by_default_on_cpu_blocks(
    tiny_gguf: Path, plain_llm: LLM, capfd: pytest.CaptureFixture[str]
) -> None:
    """Without a speculative_config GGUF blocks on CPU draft n-gram with the adaptive
    length, and the start-up output says so; method "none" turns it off (``plain_llm``)."""
    from structllm.engine import core

    assert plain_llm.engine.scheduler.drafter is None
    capfd.readouterr()
    with LLM(str(tiny_gguf), quantization="gguf", max_num_batched_tokens=256) as llm:
        drafter = llm.engine.scheduler.drafter
        assert drafter is not None
        assert drafter.config == SpeculativeConfig()
        assert drafter.step_cost == core.DRAFT_STEP_COST
    assert "speculative decoding: n-gram drafts, adaptive length" in capfd.readouterr().err


def test_off_by_default_on_float_weights(tiny_llama_dir: Path) -> None:
    """Float weights (not batch-invariant kernels) keep speculative decoding off unless
    asked for."""
    with LLM(str(tiny_llama_dir), max_num_batched_tokens=256) as llm:
        assert llm.engine.scheduler.drafter is None
