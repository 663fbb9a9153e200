"""The native decode step for Gemma 4 (``model/decode_plan.py``'s ``_add_gemma4``,
``kernels/cpu_decode.cpp``'s ``gemma4_layer``): each layer of a decode-only step in the
C++ loop gives the hidden states and K/V writes of ``Gemma4Layer.forward`` (torch's
ops) from the same inputs, within float rounding: local and global layers (each at its
head size), KV-shared layers over their source's cache, global layers of one KV head
(a file of ``attention_k_eq_v`` layers), the per-layer inputs, windows shorter than a
context, experts beside the MLP (26B-A4B's kind, their router and norms);
greedy tokens through the engine are the Python loop's; a bad ``per_layer`` is refused
by name. Run under
``STRUCTLLM_CPU_ISA=avx2`` too for the AVX2 build."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structllm import LLM, SamplingParams
from structllm.kernels import cpu_ext
from structllm.kernels.packed import block_mode
from structllm.model.gemma4 import Gemma4Layer, Gemma4Model
from tests.engine.test_decode_plan import decode_meta
from tests.support import llamacpp
from tests.support.models import GEMMA4_MOE, gguf_source_dir, sixteen_bit_q8_0

pytestmark = pytest.mark.skipif(
    cpu_ext.load_decode() is None, reason="the native decode driver does not build here"
)

# E2B's kind of layers (tests/support/models.py's "gemma4": KV-shared layers, per-layer
# inputs, global layers of twice the head size), and the same with the global layers'
# values being their keys with one KV head, as 26B-A4B's, without its experts (a GGUF
# file's such layers hold their values' projection: gguf_gemma4's docstring); and E2B's
# head sizes, 256 and 512 (the widest the C++ attention takes)
VARIANTS = {
    "e2b": {},
    "k_eq_v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    "e2b_heads": dict(head_dim=256, global_head_dim=512),
    "moe": GEMMA4_MOE,  # 26B-A4B's: experts beside the MLP, no KV sharing or per-layer inputs
}


def q8_file(default_files, **overrides: object) -> Path:  # type: ignore[no-untyped-def]
    """The tiny Gemma 4 checkpoint as llama.cpp's converter writes it in Q8_0."""
    try:
        return llamacpp.convert_hf(gguf_source_dir("gemma4", default_files, **overrides), "q8_0")
    except llamacpp.ToolMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def gemma4(request, default_files) -> LLM:  # type: ignore[no-untyped-def]
    # (16-bit activations: auto's 8-bit rounding of a slightly different input may move
    # an activation by a quantum of 1/127, which these random models amplify)
    with pytest.MonkeyPatch.context() as mp:
        sixteen_bit_q8_0(mp)
        path = q8_file(default_files, **VARIANTS[request.param])
        llm = LLM(str(path), kv_cache_memory=32 << 20, max_num_seqs=4)
        yield llm


def random_caches(caches: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
    """Random values in the shapes of the runner's caches, a KV-shared layer's entry
    still its source's tensors."""
    g = torch.Generator().manual_seed(7)
    seen: dict[int, torch.Tensor] = {}
    return [
        tuple(seen.setdefault(id(t), torch.randn(t.shape, generator=g)) for t in entry)
        for entry in caches
    ]


def cloned(caches: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
    seen: dict[int, torch.Tensor] = {}
    return [tuple(seen.setdefault(id(t), t.clone()) for t in entry) for entry in caches]


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def each_layer(llm: LLM, lens: list[int]) -> list[float]:
    """One decode-only step of ``len(lens)`` rows, layer by layer: each layer native and
    through ``Gemma4Layer.forward`` from the same input and caches (the Python loop's
    so far). Returns each layer's largest relative difference, over its output and
    every cache."""
    runner = llm.engine.runner
    model: Gemma4Model = runner.model  # type: ignore[assignment]
    plan = model._native_plan()
    assert plan is not None and model.decode_path == "native"
    nb = runner.kv_caches[0][0].shape[0]
    meta, positions = decode_meta(lens, runner.block_size, nb)
    ids = torch.tensor([(37 * i + 11) % 200 for i in range(len(lens))])
    t, cfg = len(lens), model.cfg
    out = []
    with torch.no_grad():
        x = model.embed(ids)
        pli = None if model.per_layer_inputs is None else model.per_layer_inputs(ids, x)
        glob, loc = model.rope_tables(int(meta.max_seq_len))
        ropes = glob[positions].unsqueeze(1), loc[positions].unsqueeze(1)
        pairs = [torch.view_as_real(r[positions]) for r in (glob, loc)]
        caches = random_caches(runner.kv_caches)
        step_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        modes = block_mode(t, True), block_mode(t, False)
        ops = model.cpu_ops
        for i, layer in enumerate(model.layers):
            gl: Gemma4Layer = layer  # type: ignore[assignment]
            native_caches, xn = cloned(caches), x.clone()
            plan.native.set_caches(native_caches)
            delta = plan.native.run(
                i, i + 1, xn, None, pairs, meta.slot_mapping, meta.block_tables,
                meta.seq_lens, *modes, per_layer=pli,
            )  # fmt: skip
            assert not delta.any()  # (the layer scales x itself)
            rope = ropes[1] if gl.local_rope else ropes[0]
            source = cfg.kv_source(i)
            layer_input = None if pli is None else pli[:, i]
            x = gl(x, rope, caches[i], meta, model.attn_impl, step_kv, source, layer_input, ops)
            errs = [rel(xn, x)]
            pairs_of = zip(native_caches, caches, strict=True)
            errs += [rel(a, b) for e, f in pairs_of for a, b in zip(e, f, strict=True)]
            out.append(max(errs))
        plan.native.set_caches(runner.kv_caches)
        plan._caches = runner.kv_caches
    return out


@pytest.mark.parametrize("lens", [[13], [1, 40, 9], [5] * 16])
def test_each_layer_agrees_with_the_python_layer(gemma4: LLM, lens: list[int]) -> None:
    model = gemma4.engine.runner.model
    assert type(model.attn_impl).__name__ == "CpuAttention"
    kinds = {(gl.local_rope, gl.owns_kv) for gl in model.layers}
    moe = [i for i, gl in enumerate(model.layers) if gl.moe is not None]
    # (E2B's kind: KV-shared layers of both kinds; 26B-A4B's: experts, run natively)
    assert kinds == {(True, True), (False, True)} | (
        {(True, False), (False, False)} if not moe else set()
    )
    assert all(model._native_plan().experts[i] is not None for i in moe)
    errs = each_layer(gemma4, lens)
    # (the matmuls round their activations to 16 bits per block of 32: an input that
    # differs in its last float bit can move one by a quantum, 1/32767 of its block's
    # largest; and the output norms rescale small differences up)
    assert max(errs) <= 2e-4, errs


def test_greedy_tokens_equal_the_python_loop(gemma4: LLM) -> None:
    """The same greedy tokens, but where the Python loop's two best tokens were a near
    tie (within 0.01 in logprob) at the first token that differs: with experts, the
    router's rounding may pick another expert there (test_families' Gemma 4 bars)."""
    model = gemma4.engine.runner.model
    assert "cpu_decode.cpp" in model.decode_why
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [[1, 2, 3, 4, 5], list(range(100, 137)), [9], list(range(300, 320))]
    runs = []
    for native in (True, False):
        model.native_decode = native
        runs.append(gemma4.generate(prompts, params))
    model.native_decode = True
    ties = 0
    for ours, theirs in zip(*runs, strict=True):
        if ours.token_ids == theirs.token_ids:
            continue
        j = next(
            i
            for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids, strict=True))
            if a != b
        )
        top = sorted(theirs.logprobs[j].top_logprobs, reverse=True)  # type: ignore[index]
        assert top[0] - top[1] <= 0.01, (j, top)
        ties += 1
    assert ties <= (1 if any(gl.moe is not None for gl in model.layers) else 0)


def test_a_bad_per_layer_input_is_refused(gemma4: LLM) -> None:
    runner = gemma4.engine.runner
    model = runner.model
    plan = model._native_plan()
    meta, _ = decode_meta([5], runner.block_size, 64)
    x = torch.zeros(1, model.cfg.hidden_size)
    ropes = [torch.zeros(1, d) for d in (model.cfg.head_dim_of(3), model.cfg.head_dim_of(0))]
    args = (x, None, ropes, meta.slot_mapping, meta.block_tables, meta.seq_lens, 1, 2)
    rows = {} if model.per_layer_inputs is None else {"per_layer": torch.zeros(1, 8, 16)}
    with pytest.raises(RuntimeError, match="rope table is not"):
        plan.native.run(0, 1, *args[:2], ropes[::-1], *args[3:], **rows)
    if not rows:  # (26B-A4B's kind: no per-layer inputs to give)
        assert plan.native.run(0, 1, *args).shape == x.shape
        return
    with pytest.raises(RuntimeError, match="needs per_layer float32"):
        plan.native.run(0, 1, *args)
    with pytest.raises(RuntimeError, match="needs per_layer float32"):
        plan.native.run(0, 1, *args, per_layer=torch.zeros(1, 8, 3))
