"""LoRA adapters over an unmerged base (``engine.adapters``, ``model.lora``): PEFT
adapters made by ``peft`` with random A and B on tiny seeded Llama and Qwen3
checkpoints. The exact float32 path equals ``PeftModel``'s logits and
``merge_and_unload()``'s greedy tokens; requests with different adapters and none share
steps; ``max_loras`` caps a step's adapters without starving anyone; the prefix cache
keys blocks by the adapter's load; what vLLM refuses is refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from structllm import LLM, LoRARequest, SamplingParams
from structllm.config import EngineConfig, SpeculativeConfig
from structllm.engine.core import EngineCore
from structllm.engine.scheduler import Scheduler, SchedulerOutput
from structllm.engine.speculative import MIN_MATCH, Drafter
from structllm.lora import AdapterError, read_adapter
from structllm.model.loader import prepare_model
from structllm.protocol import LoraRef
from tests.support.adapters import hf_model, peft_adapter, peft_model
from tests.support.models import EXACT, hf_greedy, hf_logits, prefill_logits, tiny_family_dir

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137)), [7, 300, 42]]
# rsLoRA with a rank and an alpha of their own for some modules (PEFT's patterns)
PATTERNS: dict[str, Any] = {
    "r": 4,
    "lora_alpha": 8,
    "use_rslora": True,
    "rank_pattern": {"q_proj": 6, r"layers\.1\.mlp\.down_proj": 2},
    "alpha_pattern": {"o_proj": 3},
}
VARIANTS: dict[str, dict[str, Any]] = {
    "all": {},
    "rslora_patterns": PATTERNS,
    "q_v_only": {"target_modules": ["q_proj", "v_proj"], "r": 4, "lora_alpha": 32},
}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def base(request, default_files) -> Path:  # type: ignore[no-untyped-def]
    return tiny_family_dir(request.param, default_files)


@pytest.fixture(scope="module")
def engine(base: Path) -> Iterator[EngineCore]:
    core = EngineCore(
        EngineConfig(
            model=str(base), kv_cache_memory=16 << 20, enable_lora=True, max_cpu_loras=4, **EXACT
        )
    )
    try:
        yield core
    finally:
        core.close()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_peft(engine: EngineCore, base: Path, variant: str) -> None:
    path = peft_adapter(base, 1, **VARIANTS[variant])
    assert engine.adapters is not None
    registry = engine.adapters
    adapter = registry.acquire(LoraRef(variant, 10 + len(variant), str(path)))
    native = registry.native
    try:
        ref, plain = peft_model(base, path), hf_model(base)
        for registry.native in {native, None}:  # cpu_lora.cpp's kernel, torch's ops
            for ids in PROMPTS:
                want = hf_logits(ref, ids)
                torch.testing.assert_close(
                    prefill_logits(engine, ids, adapter.uid), want, atol=1e-4, rtol=1e-4
                )
        # the adapter matters: its greedy picks are not the base's
        assert (want.argmax(-1) != hf_logits(plain, ids).argmax(-1)).any()
    finally:
        registry.native = native
        registry.release(adapter.uid)


# float16 storage rounds A and scale * B to 11 significant bits: the logits' error
# against PeftModel's float32 is the adapter's delta times ~2^-11 (measured on the tiny
# Llama: at most 6e-4, over the 1e-4 the float32 path holds, so ``auto`` stays float32);
# bfloat16's 8 bits, ~8x that (measured: at most 6e-3)
HALF_TOLERANCE = {"float16": 2e-3, "bfloat16": 2e-2}


@pytest.mark.parametrize("dtype", sorted(HALF_TOLERANCE))
def test_half_adapters_match_peft_within_their_rounding(tiny_llama: Path, dtype: str) -> None:
    """``--lora-dtype float16|bfloat16``: the native kernel (one call per projection)
    widens the stored halves, so it equals the torch path over the same halves to float32
    rounding, and PeftModel's float32 logits within the halves' rounding."""
    path = peft_adapter(tiny_llama, 1)
    core = EngineCore(
        EngineConfig(
            model=str(tiny_llama),
            kv_cache_memory=16 << 20,
            enable_lora=True,
            lora_dtype=dtype,
            **EXACT,
        )
    )
    try:
        registry = core.adapters
        assert registry is not None and registry.native is not None  # cpu_lora.cpp's
        adapter = registry.acquire(LoraRef("half", 1, str(path)))
        ref = peft_model(tiny_llama, path)
        for ids in PROMPTS:
            want = hf_logits(ref, ids)
            fast = prefill_logits(core, ids, adapter.uid)
            native, registry.native = registry.native, None
            try:
                slow = prefill_logits(core, ids, adapter.uid)  # torch's ops, same halves
            finally:
                registry.native = native
            torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)
            tol = HALF_TOLERANCE[dtype]
            torch.testing.assert_close(fast, want, atol=tol, rtol=tol)
    finally:
        core.close()


@pytest.fixture(scope="module")
def tiny_llama(default_files) -> Path:  # type: ignore[no-untyped-def]
    return tiny_family_dir("llama", default_files)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> Iterator[LLM]:
    # 9-token steps: prompts are prefilled in chunks beside other requests' decodes
    with LLM(
        str(tiny_llama),
        kv_cache_memory=16 << 20,
        max_num_batched_tokens=9,
        enable_lora=True,
        max_loras=3,
        **EXACT,
    ) as llm:
        yield llm


def lora(base: Path, name: str, seed: int, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, str(peft_adapter(base, seed)))


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_greedy_matches_the_merged_model(llm: LLM, tiny_llama: Path) -> None:
    a = lora(tiny_llama, "a", 1, 1)
    merged = peft_model(tiny_llama, Path(a.lora_path)).merge_and_unload()
    plain = hf_model(tiny_llama)
    for ids in PROMPTS:
        want = hf_greedy(merged, ids, 12)
        assert want != hf_greedy(plain, ids, 12)
        assert llm.generate([ids], GREEDY, lora_request=a)[0].token_ids == want


def test_mixed_batch_equals_each_alone(llm: LLM, tiny_llama: Path) -> None:
    a, b, c = (lora(tiny_llama, n, s, i) for n, s, i in (("a", 1, 1), ("b", 2, 2), ("c", 3, 3)))
    loras = [None, a, b, a, None, c]
    prompts = [PROMPTS[i % 3] + [i + 10] for i in range(6)]
    together = llm.generate(prompts, GREEDY, lora_request=loras)
    alone = [
        llm.generate([p], GREEDY, lora_request=r)[0] for p, r in zip(prompts, loras, strict=True)
    ]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    # and the adapters made a difference
    assert together[0].token_ids != together[1].token_ids or prompts[0] != prompts[1]
    base_of_1 = llm.generate([prompts[1]], GREEDY)[0].token_ids
    assert base_of_1 != together[1].token_ids


def test_prefix_cache_is_keyed_by_the_adapters_load(llm: LLM, tiny_llama: Path) -> None:
    a, b = lora(tiny_llama, "a", 1, 1), lora(tiny_llama, "b", 2, 2)
    prompt = list(range(600, 650))  # three full blocks of 16
    one = SamplingParams(temperature=0, max_tokens=4)
    runs = [llm.generate([prompt], one, lora_request=r)[0] for r in (a, b, None, a)]
    assert [r.num_cached_tokens for r in runs[:3]] == [0, 0, 0]
    assert runs[3].num_cached_tokens > 0
    assert runs[3].token_ids == runs[0].token_ids
    # the same name loaded again (a new id) never hits the earlier load's blocks
    again = LoRARequest("a", 41, a.lora_path)
    assert llm.generate([prompt], one, lora_request=again)[0].num_cached_tokens == 0


def test_max_loras_caps_a_step_and_starves_no_one(tiny_llama: Path) -> None:
    adapters = [lora(tiny_llama, n, s, s) for n, s in (("a", 1), ("b", 2), ("c", 3))]
    with LLM(
        str(tiny_llama), kv_cache_memory=16 << 20, enable_lora=True, max_loras=2, **EXACT
    ) as llm:
        sched: Scheduler = llm.engine.scheduler
        seen: list[set[int]] = []
        gauges: list[tuple[list[str], list[str]]] = []  # lora_requests_info's labels
        schedule = sched.schedule

        def counting(*args: Any, **kw: Any) -> SchedulerOutput:
            out = schedule(*args, **kw)
            seen.append({r.lora_uid for r, _ in out.scheduled if r.lora_uid})
            stats = llm.engine.stats()
            gauges.append((stats.lora_running, stats.lora_waiting))
            return out

        sched.schedule = counting  # type: ignore[method-assign]
        loras = [adapters[i % 3] for i in range(6)] + [None]
        outs = llm.generate([[5, 6, 7 + i] for i in range(7)], GREEDY, lora_request=loras)
    assert all(len(o.token_ids) == 12 for o in outs)  # everyone finished
    assert max(len(s) for s in seen) == 2
    assert set().union(*seen) == {1, 2, 3}  # every adapter's load ran
    # the metrics' running and waiting adapter names follow: two running, the third waits
    assert (["a", "b"], ["c"]) in gauges and all(len(run) <= 2 for run, _ in gauges)
    assert llm.engine.adapters is not None and not llm.engine.adapters.pins


def test_lora_off_is_a_clear_error(tiny_llama: Path) -> None:
    with (
        LLM(str(tiny_llama), kv_cache_memory=16 << 20, **EXACT) as llm,
        pytest.raises(ValueError, match="enable_lora is off"),
    ):
        llm.generate([[1, 2]], GREEDY, lora_request=lora(tiny_llama, "a", 1, 1))


def edited(src: Path, dst: Path, **config: Any) -> Path:
    """A copy of adapter ``src`` with ``config`` keys set in its adapter_config.json."""
    dst.mkdir()
    (dst / "adapter_model.safetensors").write_bytes(
        (src / "adapter_model.safetensors").read_bytes()
    )
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return dst


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 4}, "rank 8, but the adapter's config says 4"),
    ],
)
def test_what_vllm_refuses_is_refused_by_name(
    tiny_llama: Path, tmp_path: Path, config: dict[str, Any], match: str
) -> None:
    path = edited(peft_adapter(tiny_llama, 1), tmp_path / "bad", **config)
    with pytest.raises(AdapterError, match=match):
        read_adapter(path, prepare_model(str(tiny_llama)).config, 16)


def test_rank_above_the_limit_and_another_base_are_refused(
    tiny_llama: Path, default_files: Any
) -> None:
    path = peft_adapter(tiny_llama, 1)
    cfg = prepare_model(str(tiny_llama)).config
    with pytest.raises(AdapterError, match="above max_lora_rank 4"):
        read_adapter(path, cfg, 4)
    wider = msgspec.structs.replace(cfg, intermediate_size=96)  # another base's MLP
    with pytest.raises(AdapterError, match="do not fit the base"):
        read_adapter(path, wider, 16)
    gemma = prepare_model(str(tiny_family_dir("gemma", default_files))).config
    with pytest.raises(AdapterError, match="not gemma"):
        read_adapter(path, gemma, 16)
    with pytest.raises(AdapterError, match="No adapter found"):
        read_adapter(tiny_llama, cfg, 16)
    embedding = peft_adapter(tiny_llama, 1, target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(AdapterError, match="embedding"):
        read_adapter(embedding, cfg, 16)


def test_fused_cpu_ops_add_the_adapter_too(tiny_llama: Path) -> None:
    # the fused element-wise ops (the quantized formats' layer loop) on the same float32
    # weights: prefill, then decode-only steps, which leave the native decode loop to
    # the steps without adapter rows
    a = lora(tiny_llama, "a", 1, 1)
    merged = peft_model(tiny_llama, Path(a.lora_path)).merge_and_unload()
    with LLM(str(tiny_llama), kv_cache_memory=16 << 20, enable_lora=True, **EXACT) as llm:
        model = llm.engine.runner.model
        if not model.use_cpu_ops():
            pytest.skip("the fused CPU ops do not build here")
        for ids in PROMPTS:
            want = hf_greedy(merged, ids, 12)
            assert llm.generate([ids], GREEDY, lora_request=a)[0].token_ids == want
        assert llm.generate([PROMPTS[1]], GREEDY)[0].token_ids == hf_greedy(
            hf_model(tiny_llama), PROMPTS[1], 12
        )


def test_adapters_in_use_are_never_evicted(tiny_llama: Path) -> None:
    # one adapter kept loaded and one per step: b's request loads b past the cap while
    # a's runs (a stays: pinned), and a's output is its output alone
    a, b = lora(tiny_llama, "a", 1, 1), lora(tiny_llama, "b", 2, 2)
    prompts = [PROMPTS[1], PROMPTS[0]]
    with LLM(
        str(tiny_llama),
        kv_cache_memory=16 << 20,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,
        **EXACT,
    ) as llm:
        registry = llm.engine.adapters
        assert registry is not None
        both = llm.generate(prompts, GREEDY, lora_request=[a, b])
        assert not registry.pins and list(registry.loaded) == [2]  # back to one, b last
        alone = llm.generate([prompts[0]], GREEDY, lora_request=a)[0]
        assert both[0].token_ids == alone.token_ids
        # a was evicted once b's request ended, and loaded again: a third load
        assert registry.num_loads == 3 and list(registry.loaded) == [1]


# one block type per fused matmul (test_quant_model's), so every matmul stays in blocks
QTYPES = {
    "attn_output.weight": "Q8_0",
    "token_embd.weight": "Q8_0",
    "output.weight": "Q8_0",
    "attn_q.weight": "Q4_0",
    "attn_k.weight": "Q4_0",
    "attn_v.weight": "Q4_0",
    "ffn_gate.weight": "Q8_0",
    "ffn_up.weight": "Q8_0",
    "ffn_down.weight": "Q4_1",
}


@pytest.mark.skipif(
    __import__("structllm.kernels.cpu_ext", fromlist=["x"]).best_isa() is None,
    reason="no AVX2 block kernels",
)
def test_a_quantized_base_with_an_adapter_agrees_with_its_dequantised_self(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a GGUF base (its q/k rows in llama.cpp's layout) kept in blocks, with the fused CPU
    # ops, against the exact float32 path over the same file (its weights dequantised):
    # equal on the block kernels' float path; and its greedy tokens with drafts (the
    # verification rows of a request with an adapter) equal those without
    from structllm.kernels import packed
    from structllm.model.files import default_model_path
    from tests.support.models import write_tiny_gguf

    path = tmp_path / "tiny-blocks.gguf"
    write_tiny_gguf(path, hf_model(tiny_llama_dir), default_model_path(), QTYPES)
    ref = LoraRef("a", 1, str(peft_adapter(tiny_llama_dir, 1)))

    def start(**kw: Any) -> EngineCore:
        cfg = EngineConfig(model=str(path), kv_cache_memory=16 << 20, enable_lora=True, **kw)
        return EngineCore(cfg)

    # float32 adapters on both, so that only the base's kernels differ (``auto`` stores
    # them in float16 over GGUF blocks: test_half_adapters_match_peft_within_their_rounding)
    blocks, exact = start(quantization="gguf", lora_dtype="float32"), start(**EXACT)
    assert blocks.adapters is not None and blocks.adapters.dtype == torch.float32
    assert blocks.adapters is not None and exact.adapters is not None
    monkeypatch.setattr(packed, "INT8_MIN_M", 0)
    monkeypatch.setattr(packed, "INT16_MIN_M", 0)
    ua, ub = blocks.adapters.acquire(ref).uid, exact.adapters.acquire(ref).uid
    for ids in PROMPTS:
        with_a = prefill_logits(blocks, ids, ua)
        want = prefill_logits(exact, ids, ub)  # (the fused ops round otherwise: 1e-3)
        torch.testing.assert_close(with_a, want, atol=1e-3, rtol=1e-3)
        assert torch.equal(with_a.argmax(-1), want.argmax(-1))
        assert (with_a.argmax(-1) != prefill_logits(blocks, ids).argmax(-1)).any()
    monkeypatch.undo()
    a = LoRARequest("a", 1, ref.path)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    loras = [a, None, a]
    with LLM(str(path), kv_cache_memory=16 << 20, enable_lora=True, **NO_DRAFTS) as llm:
        plain = llm.generate(PROMPTS, params, lora_request=loras)
        oracle = Oracle({tuple(p): o.token_ids for p, o in zip(PROMPTS, plain, strict=True)})
        drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3), oracle)
        llm.engine.scheduler.drafter = drafter
        llm.engine.scheduler.max_draft_step_tokens = None  # drafts in batches too
        drafted = llm.generate(PROMPTS, params, lora_request=loras)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert 0 < drafter.stats.num_accepted_tokens < drafter.stats.num_draft_tokens


NO_DRAFTS: dict[str, Any] = {"speculative_config": {"method": "none"}}


@pytest.mark.skipif(
    __import__("structllm.kernels.cpu_ext", fromlist=["x"]).best_isa() is None,
    reason="no AVX2 block kernels",
)
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_decode_steps_with_adapters_take_the_native_loop(
    tiny_llama_dir: Path, tmp_path: Path, dtype: str
) -> None:
    # a GGUF base in blocks, whose decode steps run the native layer loop
    # (cpu_decode.cpp): requests [a, base, b, a] (two adapters, rows of a apart, a row
    # without any) decode through it, adding B (A x) after each matmul with the kernels
    # the Python loop's lora_add runs: the same tokens and logprobs as the Python loop;
    # and which loop ran: the native one takes every decode step, the Python one none
    from structllm.model.files import default_model_path
    from structllm.model.llama import DecoderLayer
    from tests.support.models import write_tiny_gguf

    path = tmp_path / "tiny-blocks.gguf"
    write_tiny_gguf(path, hf_model(tiny_llama_dir), default_model_path(), QTYPES)
    a = LoRARequest("a", 1, str(peft_adapter(tiny_llama_dir, 1)))
    b = LoRARequest("b", 2, str(peft_adapter(tiny_llama_dir, 2)))
    loras = [a, None, b, a]
    prompts = [*PROMPTS, [9, 8, 7, 6]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    runs = []
    with LLM(
        str(path),
        kv_cache_memory=16 << 20,
        enable_lora=True,
        max_loras=2,
        lora_dtype=dtype,
        **NO_DRAFTS,
    ) as llm:
        model = llm.engine.runner.model  # type: ignore[union-attr]
        assert model.decode_path == "native"
        plan = model._native_plan()
        native_steps: list[int] = []  # rows of adapters in each native step
        python_steps: list[int] = []  # decode-only steps through the Python layer loop
        run, fused = plan.run, DecoderLayer.forward_fused
        layer0 = model.layers[0]

        def counted_run(*args: Any, **kw: Any) -> Any:
            lora = args[5] if len(args) > 5 else kw.get("lora")
            native_steps.append(0 if lora is None else len(lora.rows))
            return run(*args, **kw)

        def counted_fused(self: Any, x: Any, *args: Any, **kw: Any) -> Any:
            if self is layer0 and args[4].num_decodes == x.shape[0]:
                python_steps.append(1)
            return fused(self, x, *args, **kw)

        plan.run = counted_run
        for native in (True, False):
            model.native_decode = native
            native_steps.clear(), python_steps.clear()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(DecoderLayer, "forward_fused", counted_fused)
                outs = llm.generate(prompts, params, lora_request=loras)
            runs.append([run_of(o) for o in outs])
            if native:  # every decode step: 4 rows, 3 of them with an adapter
                assert native_steps and set(native_steps) == {3} and not python_steps
            else:
                assert not native_steps and python_steps
        alone = llm.generate([prompts[2]], params, lora_request=b)[0]
        base = llm.generate([prompts[0]], params)[0]
    assert runs[0] == runs[1]  # the same kernels in the same order: the same bits
    assert [t for t, _ in runs[0][2]] == alone.token_ids  # b's row, beside others, as alone
    assert [t for t, _ in runs[0][0]] != base.token_ids  # the adapter matters


def run_of(out: Any) -> list[tuple[int, list[float]]]:
    """A request's tokens and their logprobs (the chosen token's, then the top ones)."""
    return [
        (t, [lp.logprob, *lp.top_logprobs])
        for t, lp in zip(out.token_ids, out.logprobs, strict=True)
    ]


class Oracle:
    """Drafts a plain run's continuation, its last draft wrong (some rows rejected)."""

    last_match = MIN_MATCH  # drafts as if from a long match

    def __init__(self, plain: dict[tuple[int, ...], list[int]]) -> None:
        self.plain = plain

    def propose(self, req: Any, k: int) -> list[int]:
        out = self.plain[tuple(req.token_ids[: req.prompt_len])]
        truth = out[req.num_output_tokens : req.num_output_tokens + k]
        return truth[:-1] + [(t + 1) % 49152 for t in truth[-1:]]

    def finish(self, req: Any) -> None:
        pass


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # q/k rows interleaved in the file, or not
def test_a_gguf_lora_file_equals_its_peft_directory(family: str, default_files: Any) -> None:
    # llama.cpp's convert_lora_to_gguf.py of a PEFT adapter: the same logits over the
    # Hugging Face base, and over the same base as a GGUF file (llama.cpp's q/k layout)
    # the same logits and greedy tokens
    from tests.support import llamacpp

    base = tiny_family_dir(family, default_files)
    peft = peft_adapter(base, 1)
    try:
        gguf_base = llamacpp.convert_hf(base, "f32")
        gguf_lora = llamacpp.convert_lora(peft, base)
    except llamacpp.ToolMissing as e:
        pytest.skip(str(e))
    spec = read_adapter(gguf_lora, prepare_model(str(base)).config, 16)
    assert spec.gguf and len(spec.targets) == 7 * 3

    def start(model: Path) -> EngineCore:
        cfg = EngineConfig(model=str(model), kv_cache_memory=16 << 20, enable_lora=True, **EXACT)
        return EngineCore(cfg)

    hf, gg = start(base), start(gguf_base)
    assert hf.adapters is not None and gg.adapters is not None
    runs = [
        (e, e.adapters.acquire(LoraRef(n, i, str(p))).uid)
        for e in (hf, gg)
        for n, i, p in (("peft", 1, peft), ("gguf", 2, gguf_lora))
        if e.adapters is not None
    ]
    for ids in PROMPTS:
        want = prefill_logits(runs[0][0], ids, runs[0][1])
        for engine, uid in runs[1:]:
            torch.testing.assert_close(prefill_logits(engine, ids, uid), want, atol=1e-4, rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for model, adapter in ((base, peft), (gguf_base, gguf_lora)):
        with LLM(str(model), kv_cache_memory=16 << 20, enable_lora=True, **EXACT) as llm:
            r = LoRARequest("x", 1, str(adapter))
            outs.append([o.token_ids for o in llm.generate(PROMPTS, params, lora_request=r)])
    assert outs[0] == outs[1]


def test_a_constrained_request_runs_with_its_adapter(llm: LLM, tiny_llama: Path) -> None:
    # the grammar's mask over the adapter's logits; the pin held while its matcher was
    # built goes with the request
    from structllm.protocol import StructuredOutputs

    a = lora(tiny_llama, "a", 1, 1)
    choices = ["red", "green", "blue"]
    sp = SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputs(choice=choices)
    )
    out = llm.generate([PROMPTS[1]], sp, lora_request=a)[0]
    assert out.text in choices
    assert llm.engine.adapters is not None and not llm.engine.adapters.pins


def test_tensor_parallel_shards_the_adapters_with_their_matrices(
    llm: LLM, tiny_llama: Path
) -> None:
    # 2 ranks (one KV group and half the MLP each): q/k/v and gate/up adapters keep their
    # rows of B, o and down their input columns of A; a mixed batch over three adapters,
    # two a step, so the worker loads, evicts and loads again by rank 0's uids
    a, b, c = (lora(tiny_llama, n, s, i) for n, s, i in (("a", 1, 1), ("b", 2, 2), ("c", 3, 3)))
    loras = [None, a, b, c, a]
    prompts = [PROMPTS[i % 3] + [i + 20] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    want = llm.generate(prompts, params, lora_request=loras)
    with LLM(
        str(tiny_llama),
        kv_cache_memory=16 << 20,
        max_num_batched_tokens=9,
        enable_lora=True,
        max_loras=2,
        tensor_parallel_size=2,
        **EXACT,
    ) as tp:
        got = tp.generate(prompts, params, lora_request=loras)
    for w, g in zip(want, got, strict=True):
        assert w.logprobs is not None and g.logprobs is not None
        # the all-reduce sums the ranks' partial products in another order: last bits
        diff = max(abs(x.logprob - y.logprob) for x, y in zip(w.logprobs, g.logprobs, strict=True))
        gaps = [lp.top_logprobs[0] - lp.top_logprobs[1] for lp in w.logprobs]
        assert min(gaps) > 1e-3, "a near-tie: choose another prompt"
        assert diff < 1e-4
        assert g.token_ids == w.token_ids
    # and the adapters made a difference to every request that has one
    base = llm.generate(prompts[1:], params)
    assert all(w.token_ids != x.token_ids for w, x in zip(want[1:], base, strict=True))
