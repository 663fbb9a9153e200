"""The native decode step for hybrid models (``model/decode_plan.py``'s recurrent
layers, ``kernels/cpu_decode.cpp``'s hybrid section): a decode-only step of LFM2 (short
convolutions around attention), of Qwen3.5 (Gated DeltaNet, gated attention, partial
rotary), of Granite 4 (Mamba-2 around NoPE attention, residual multipliers) and of
Nemotron-H (single-sublayer blocks: Mamba-2, relu-squared MLP, NoPE attention) in one
C++ call per segment gives the hidden states, K/V writes and recurrent states of the
Python fused loop bit for bit, fresh rows (a zero state) and reused slots included;
greedy tokens and logprobs through the engine are the same; bad state slots are refused
by name; experts in a hybrid model's layers (Qwen3.5-MoE's, Qwen3-Next's) run inside
the native call, or from Python between two calls where they cannot. Run under
``STRUCTLLM_CPU_ISA=avx2`` too for the AVX2 build."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from structllm import LLM, SamplingParams
from structllm.kernels import cpu_ext
from structllm.model import decode_plan, llama
from structllm.model.hybrid import HybridModel, RecurrentLayer
from tests.engine.test_decode_plan import decode_meta
from tests.support import llamacpp
from tests.support.models import CONVERTER_ARGS, GRANITE_MOE, gguf_source_dir

pytestmark = pytest.mark.skipif(
    cpu_ext.load_recurrent() is None or cpu_ext.load_decode() is None,
    reason="the recurrent kernels or the native decode driver do not build here",
)


def q8_file(family: str, default_files, **overrides: object) -> Path:  # type: ignore[no-untyped-def]
    """The family's tiny GGUF file (with ``overrides`` of its config) in Q8_0, as
    llama.cpp's converter writes it (no llama-quantize needed)."""
    try:
        source = gguf_source_dir(family, default_files, **overrides)
        return llamacpp.convert_hf(source, "q8_0", *CONVERTER_ARGS.get(family, ()))
    except llamacpp.ToolMissing as e:
        pytest.skip(str(e))


# LFM2: short convolutions; Qwen3.5: Gated DeltaNet, gated attention, partial rotary;
# Granite 4: Mamba-2 (grouped B and C, a gated group norm), NoPE attention; Nemotron-H:
# its Mamba-2, MLP-only and attention-only blocks
@pytest.fixture(scope="module", params=["lfm2", "qwen3_5", "granitemoehybrid", "nemotron_h"])
def hybrid(request, default_files) -> LLM:  # type: ignore[no-untyped-def]
    path = q8_file(request.param, default_files)
    return LLM(str(path), kv_cache_memory=32 << 20, max_num_seqs=4)


def random_caches(
    model: HybridModel, caches: list[tuple[torch.Tensor, ...]]
) -> list[tuple[torch.Tensor, ...]]:
    """Random values in the shapes of the runner's caches: K/V pairs, states."""
    g = torch.Generator().manual_seed(7)
    return [tuple(torch.randn(t.shape, generator=g) for t in entry) for entry in caches]


def both_paths(llm: LLM, lens: list[int], slots: list[int]) -> None:
    """One decode-only step of ``len(lens)`` rows (a context of 1: a fresh state) in
    state ``slots``, native and Python, from the same random caches and states: hidden
    states, caches and states equal, bit for bit."""
    runner = llm.engine.runner
    model: HybridModel = runner.model  # type: ignore[assignment]
    nb = next(e[0].shape[0] for e in runner.kv_caches if len(e) == 2)
    caches = random_caches(model, runner.kv_caches)
    copies = [tuple(t.clone() for t in entry) for entry in caches]
    meta, positions = decode_meta(lens, runner.block_size, nb)
    meta = dataclasses.replace(meta, state_slots=list(slots))
    ids = torch.tensor([(37 * i + 11) % 200 for i in range(len(lens))])
    cuts: list[int] = []
    with torch.no_grad():
        model.native_decode = False
        want = model.forward(ids, positions, copies, meta)
        model.native_decode = True
        got = model.forward(ids, positions, caches, meta, lambda: cuts.append(1))
    assert model.decode_path == "native"
    assert torch.equal(got, want)
    for entry, copy in zip(caches, copies, strict=True):
        for t, c in zip(entry, copy, strict=True):
            assert torch.equal(t, c)
    assert len(cuts) == (len(model.layers) - 1) // llama.CHECK_EVERY


def test_native_step_equals_python_loop(hybrid: LLM) -> None:
    model = hybrid.engine.runner.model
    assert any(model.state_shapes(i) for i in range(len(model.layers)))  # recurrent layers
    assert "cpu_decode.cpp" in model.decode_why
    both_paths(hybrid, [13], [2])  # one row
    both_paths(hybrid, [1, 40, 9], [3, 0, 1])  # three rows, the first fresh


def same_tokens_both_loops(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> None:
    """Greedy tokens and logprobs through the engine: the native loop's equal the
    Python loop's."""
    model = llm.engine.runner.model
    runs = []
    for native in (True, False):
        model.native_decode = native
        outs = llm.generate(prompts, params)
        runs.append([(o.token_ids, [lp.top_logprobs for lp in o.logprobs]) for o in outs])
    model.native_decode = True
    assert runs[0] == runs[1]


def test_greedy_tokens_and_logprobs_equal(hybrid: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    prompts = [[1, 2, 3, 4, 5], list(range(100, 137)), [9], list(range(300, 320))]
    same_tokens_both_loops(hybrid, prompts, params)


def test_bad_state_slots_are_refused(hybrid: LLM) -> None:
    runner = hybrid.engine.runner
    model = runner.model
    plan = model._native_plan()
    meta, _ = decode_meta([5], runner.block_size, 64)
    x, rope = torch.zeros(1, model.cfg.hidden_size), torch.zeros(1, model.cfg.head_dim)
    args = (x, None, [rope], meta.slot_mapping, meta.block_tables, meta.seq_lens, 1, 2)
    fresh = torch.zeros(1, dtype=torch.bool)
    plan.native.set_caches(runner.kv_caches)
    with pytest.raises(RuntimeError, match="state slot 99 out of range"):
        plan.native.run(0, 1, *args, state_slots=torch.tensor([99]), fresh=fresh)
    with pytest.raises(RuntimeError, match="need state_slots and fresh"):
        plan.native.run(0, 1, *args)
    with pytest.raises(RuntimeError, match="state_slots must be int64"):
        plan.native.run(0, 1, *args, state_slots=torch.tensor([0], dtype=torch.int32), fresh=fresh)
    with pytest.raises(RuntimeError, match="(its one state tensor|states must be)"):
        plan.native.set_caches([(t, t) for t in (runner.kv_caches[0][0],)] * len(model.layers))
    plan.native.set_caches(runner.kv_caches)  # as it was (the plan keeps them)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next", "granitemoehybrid"])
def test_experts_in_hybrid_layers_run_in_the_native_call(
    family: str, default_files, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    # experts with a gated shared expert beside Gated DeltaNet and gated attention
    # (Qwen3.5-MoE, Qwen3-Next), or an ungated shared MLP beside Mamba-2 and residual
    # multipliers (Granite 4's MoE kind): the router, the experts (cpu_moe.cpp) and the
    # shared expert (set_shared) inside the native call, a recurrent layer's through
    # set_experts; one call a step; bit for bit the Python loop's (its layers with
    # experts on the same fused router and experts)
    overrides = GRANITE_MOE if family == "granitemoehybrid" else {}
    path = q8_file(family, default_files, **overrides)
    llm = LLM(str(path), kv_cache_memory=32 << 20, max_num_seqs=4)
    model = llm.engine.runner.model
    plan = model._native_plan()
    assert model.decode_path == "native"
    moe = [i for i, layer in enumerate(model.layers) if layer.moe is not None]
    assert moe and all(plan.experts[i] is not None for i in moe)
    assert any(isinstance(model.layers[i], RecurrentLayer) for i in moe)
    assert len(plan.segments) == -(-len(model.layers) // llama.CHECK_EVERY)
    both_paths(llm, [13], [2])
    both_paths(llm, [1, 40, 9], [3, 0, 1])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], list(range(100, 137)), [9]]
    native = [o.token_ids for o in llm.generate(prompts, params)]
    model.native_decode = False
    python = [o.token_ids for o in llm.generate(prompts, params)]
    model.native_decode = True
    assert native == python
    # experts the native call cannot run (made so here) run from Python between two
    # native calls, cut after their layer (a recurrent layer's after its post-norm)
    monkeypatch.setattr(decode_plan, "_native_experts", lambda dl: None)
    model._decode_plan = None
    plan = model._native_plan()
    assert [end for _, end, _ in plan.segments if plan.cut(end - 1)] == [i + 1 for i in moe]
    both_paths(llm, [13], [2])
    both_paths(llm, [1, 40, 9], [3, 0, 1])
    model._decode_plan = None


def test_nemotron_3_moe_blocks_run_in_the_native_call(default_files) -> None:  # type: ignore[no-untyped-def]
    # Nemotron 3's MoE blocks (a grouped sigmoid router with its choice bias, relu²
    # experts between the latent projections, the shared relu² MLP) inside the native
    # call (add_moe_block): one call a step, bit for bit the Python loop's (its blocks on
    # the same router, cpu_mla.cpp's group_route), greedy tokens equal
    from structllm.model.nemotron_h import MoeBlock
    from tests.engine.test_nemotron_h import MOE_GGUF

    if cpu_ext.load_mla() is None or cpu_ext.load_moe() is None:
        pytest.skip("the grouped router (cpu_mla.cpp) or the expert kernels do not build here")
    # (a shared MLP 64 wide: the converter keeps MOE_GGUF's 48 as float16, not blocks)
    path = q8_file(
        "nemotron_h", default_files, **{**MOE_GGUF, "moe_shared_expert_intermediate_size": 64}
    )
    llm = LLM(str(path), kv_cache_memory=32 << 20, max_num_seqs=4)
    model = llm.engine.runner.model
    blocks = [m for m in model.layers if isinstance(m, MoeBlock)]
    assert blocks and all(b.latent_down is not None for b in blocks)
    g = torch.Generator().manual_seed(3)
    for b in blocks:  # (the converter's biases are transformers' zeros: make the choice show)
        b.router_bias.copy_(0.05 * torch.randn(b.router_bias.shape, generator=g))
    plan = model._native_plan()
    assert model.decode_path == "native", model.decode_why
    assert all(plan.experts[i] is not None for i, m in enumerate(model.layers) if m in blocks)
    assert len(plan.unchecked) == 1  # no cut
    both_paths(llm, [13], [2])
    both_paths(llm, [1, 40, 9], [3, 0, 1])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    same_tokens_both_loops(llm, [[1, 2, 3, 4, 5], list(range(100, 137)), [9]], params)
