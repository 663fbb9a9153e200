"""``--kv-cache-dtype``: the option, the ``auto`` rule, sizing, an engine serving with a
float16 cache, and (slow) teacher-forced greedy agreement of float16 with float32 KV on
the default model.

The kernels themselves (C++ and Triton) are tested against the reference with float16
caches in ``test_cpu_attention.py`` and ``test_triton_kernels.py``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.engine.request import Request
from structllm.engine.runner import ModelRunner, batch_from_step
from structllm.engine.scheduler import SchedulerOutput
from structllm.model.formats import WeightFormat, resolve_kv_cache_dtype
from structllm.protocol import SamplingParams
from tests.support.models import EXACT

CPU = torch.device("cpu")


def test_a_bad_value_is_refused_naming_the_option() -> None:
    with pytest.raises(
        ValueError, match="kv_cache_dtype must be auto, float32 or float16, got 'int8'"
    ):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="bfloat16")


def test_the_cli_flag_reaches_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from structllm.cli import _engine_args, _engine_kwargs

    p = argparse.ArgumentParser()
    _engine_args(p)
    assert p.parse_args([]).kv_cache_dtype == "auto"  # the default is EngineConfig's
    assert (
        EngineConfig(**_engine_kwargs(p.parse_args(["--kv-cache-dtype", "float16"]))).kv_cache_dtype
        == "float16"
    )  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "fp8"])
    assert "--kv-cache-dtype" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fmt", "want"),
    [
        (WeightFormat(torch.float32), torch.float32),  # the exact path stays exact
        (WeightFormat(torch.float32, blocks=True, half="file"), torch.float16),
        (WeightFormat(torch.float32, half="all"), torch.float16),
        (WeightFormat(torch.bfloat16), torch.bfloat16),  # --dtype bfloat16: the model's dtype
    ],
    ids=["exact", "gguf-blocks", "float16-weights", "bfloat16"],
)
def test_auto_on_cpu(fmt: WeightFormat, want: torch.dtype) -> None:
    config = EngineConfig(dtype="bfloat16" if fmt.dtype == torch.bfloat16 else "auto")
    assert resolve_kv_cache_dtype(config, CPU, fmt) == want


def test_auto_without_weights_follows_the_flags() -> None:
    """The null model has no weight format: the exact flags keep float32."""
    assert resolve_kv_cache_dtype(EngineConfig(**EXACT), CPU, None) == torch.float32
    assert resolve_kv_cache_dtype(EngineConfig(), CPU, None) == torch.float16


def test_explicit_values_and_cuda_rules() -> None:
    exact = WeightFormat(torch.float32)
    assert (
        resolve_kv_cache_dtype(EngineConfig(kv_cache_dtype="float16", **EXACT), CPU, exact)
        == torch.float16
    )
    blocks = WeightFormat(torch.float32, blocks=True)
    assert (
        resolve_kv_cache_dtype(EngineConfig(kv_cache_dtype="float32"), CPU, blocks) == torch.float32
    )
    cuda = torch.device(
        "cuda"
    )  # resolve_* only looks at the type (and bf16 support, for --dtype auto)
    assert (
        resolve_kv_cache_dtype(EngineConfig(dtype="float16"), cuda, WeightFormat(torch.float16))
        == torch.float16
    )
    assert (
        resolve_kv_cache_dtype(EngineConfig(dtype="float32"), cuda, WeightFormat(torch.float32))
        == torch.float32
    )
    with pytest.raises(ValueError, match="--kv-cache-dtype float32 on CUDA needs --dtype float32"):
        resolve_kv_cache_dtype(
            EngineConfig(dtype="float16", kv_cache_dtype="float32"),
            cuda,
            WeightFormat(torch.float16),
        )


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_cache_is_allocated_and_sized_in_the_kv_dtype(tiny_llama_dir: Path, kv: str) -> None:
    """The same bytes hold twice the blocks in float16; the tensors are that dtype."""
    budget = 4 << 20
    eng = EngineCore(
        EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=budget, kv_cache_dtype=kv, **EXACT)
    )
    assert isinstance(eng.runner, ModelRunner)
    caches = [t for pair in eng.runner.kv_caches for t in pair]
    assert {t.dtype for t in caches} == {getattr(torch, kv)}
    cfg = eng.files.config
    per_block_f32 = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * eng.config.block_size * 4
    assert eng.num_blocks == budget // per_block_f32 * (2 if kv == "float16" else 1)
    assert sum(t.numel() * t.element_size() for t in caches) <= budget


def test_auto_picks_float16_except_on_the_exact_path(tiny_llama_dir: Path) -> None:
    from structllm.kernels import packed

    exact = EngineCore(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=4 << 20, **EXACT))
    assert exact.kv_dtype == torch.float32
    if packed.half_linear_available():  # auto runs a float checkpoint with float16 weights
        auto = EngineCore(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=4 << 20))
        assert auto.weight_format.half == "all" and auto.kv_dtype == torch.float16


def test_an_engine_with_a_float16_cache_serves_requests(tiny_llama_dir: Path) -> None:
    """Prefill in chunks (a 64-token budget), prefix-cache hits and decode across block
    ends, on the C++ kernel (the CPU default), all with a float16 cache."""
    from structllm import LLM, SamplingParams

    llm = LLM(
        str(tiny_llama_dir),
        kv_cache_memory=4 << 20,
        kv_cache_dtype="float16",
        max_num_batched_tokens=64,
    )
    assert llm.engine.kv_dtype == torch.float16
    prompts = [list(range(100, 230)), list(range(100, 230)), [7], "Hello, my name is"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [20] * 4
    assert outs[0].token_ids == outs[1].token_ids  # the second one read the first's cached prefix
    assert outs[1].num_cached_tokens > 0


# -- the default model (slow) -------------------------------------------------------------


def teacher_forced_top1(eng: EngineCore, seqs: list[tuple[list[int], int]]) -> list[list[int]]:
    """For each ``(ids, start)``: the argmax predictions of ``ids[start:]``, with the prompt
    ``ids[:start]`` prefilled in one step and every later token fed as a decode step (all
    sequences batched), so each prediction after the first reads the whole context back
    from the paged KV cache, which is what the cache's dtype changes. Needs equally long
    continuations; blocks are freed afterwards."""
    n = len(seqs[0][0]) - seqs[0][1]
    assert all(len(ids) - start == n for ids, start in seqs)
    assert isinstance(eng.runner, ModelRunner)
    runner = eng.runner
    reqs = [
        Request(f"tf-{i}", ids, SamplingParams(max_tokens=1), 1) for i, (ids, _) in enumerate(seqs)
    ]

    def step(scheduled: list[tuple[Request, int]]) -> list[int]:
        batch = runner.prepare(SchedulerOutput(scheduled))
        rows = [
            end - 1 for end in batch.step.query_start[1:]
        ]  # each sequence's last token predicts the next
        logits = runner.run(
            batch_from_step(msgspec.structs.replace(batch.step, logit_rows=rows), eng.device)
        )
        assert logits is not None
        for r, k in scheduled:
            r.num_computed_tokens += k
        return [int(t) for t in logits.argmax(-1)]

    preds: list[list[int]] = [[] for _ in seqs]
    try:
        for r in reqs:
            assert eng.kv.allocate(r, len(r.token_ids))
        for i, t in enumerate(step([(r, start) for r, (_, start) in zip(reqs, seqs, strict=True)])):
            preds[i].append(t)
        for _ in range(n - 1):
            for i, t in enumerate(step([(r, 1) for r in reqs])):
                preds[i].append(t)
    finally:
        for r in reqs:
            eng.kv.free_blocks(r)
    return preds


CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three prime numbers and explain why they are prime.",
    "How do I boil an egg?",
    "Tell me a short story about a robot who learns to paint.",
    "What are the main differences between Python and C?",
    "Give me a recipe for pancakes.",
]
N_TOKENS = 64


@pytest.mark.slow
def test_float16_kv_agrees_with_float32_kv_on_the_default_model(  # type: ignore[no-untyped-def]
    tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default weights, float16 vs float32 KV: teacher-forced greedy top-1 agreement
    on float32-KV's own greedy continuations of 8 chat prompts x 64 tokens (each
    prediction after the first reads the cache). Measured when written: 100% here, and
    100% with 96 tokens each for these and for the exact float32 weights, whose
    free-running greedy outputs were also identical (768/768 tokens both).

    The cache's dtype in isolation: activations on the int16 path. With the default int8
    MLP, whose 8-bit rounding turns the cache's small differences into visible ones now
    and then, the same comparison gave 503/512 (98.2%); what the int8 MLP itself costs
    is measured in test_quant_model.py."""
    from structllm import LLM
    from structllm import SamplingParams as Sampling
    from structllm.kernels import packed

    monkeypatch.setattr(packed, "INT8_MIN_M", 0)

    prompts = [tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    greedy = Sampling(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    engines = {}
    for kv in ("float32", "float16"):
        llm = LLM(kv_cache_memory=64 << 20, kv_cache_dtype=kv, enable_prefix_caching=False)
        assert llm.engine.kv_dtype == getattr(torch, kv)
        engines[kv] = llm.engine
        if kv == "float32":
            out32 = [o.token_ids for o in llm.generate(prompts, greedy)]
    seqs = [(p + o, len(p)) for p, o in zip(prompts, out32, strict=True)]
    ref = teacher_forced_top1(engines["float32"], seqs)
    assert ref == out32  # teacher forcing on float32's own tokens reproduces them
    got = teacher_forced_top1(engines["float16"], seqs)
    same = sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
    total = sum(len(r) for r in ref)
    print(
        f"\nfloat16 vs float32 KV: teacher-forced top-1 agreement "
        f"{same}/{total} = {same / total:.4f}"
    )
    assert same / total >= 0.99
