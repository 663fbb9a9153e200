"""The native decode step (``model/decode_plan.py``, ``kernels/cpu_decode.cpp``): a
decode-only step's layers in one C++ call per segment give the hidden states and K/V
writes of the Python fused loop bit for bit, for every family on the fused path (q/k
norms per head and over the projection, GeGLU, post-norms, windows, soft-caps, layers
without rotary embedding, residual multipliers, mixed-type matrices), float32 and
float16 caches, one and several rows; greedy tokens through the engine are the same;
families it cannot take keep the Python loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.kernels.attention import AttentionMetadata
from structllm.model import decode_plan, llama
from structllm.model.llama import LlamaModel
from tests.support import llamacpp
from tests.support.models import gguf_source_dir

# (family, quantisation): the int8 MLP path (Q4_0), the int16 one (Q8_0), mixed types
CASES = [
    ("qwen3", "Q4_0"),  # q/k norms per head
    ("gemma2", "Q8_0"),  # GeGLU, post-norms, windows, attention and final soft-caps
    ("gemma3", "Q4_0"),  # local rope table for the windowed layers, q/k norms
    ("olmo2", "Q4_0"),  # no pre-norms, q/k norms over the whole projection
    ("granite", "Q4_0"),  # residual and embedding multipliers
    ("smollm3", "Q4_0"),  # layers without rotary embedding
    ("phi3", "Q8_0"),  # partial rotary
    ("qwen2_moe", "Q8_0"),  # a shared expert and its gate, in the native call (set_shared)
    ("qwen3", "F16"),  # an F16 file's matrices: float16 rows (HalfMatrix), any width
]


def family_file(family: str, default_files, qtype: str) -> Path:  # type: ignore[no-untyped-def]
    try:
        f32 = llamacpp.convert_hf(gguf_source_dir(family, default_files), "f32")
        return llamacpp.quantize(f32, qtype)
    except llamacpp.ToolMissing as e:
        pytest.skip(str(e))


def engine(path: Path | None, **kw: object) -> EngineCore:
    return EngineCore(
        EngineConfig(model=str(path) if path else None, kv_cache_memory=32 << 20, **kw)  # type: ignore[arg-type]
    )


def decode_meta(lens: list[int], bs: int, nb: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """A decode-only step of ``len(lens)`` sequences whose contexts (this token
    included) are ``lens``, on disjoint shuffled blocks; and their positions."""
    g = torch.Generator().manual_seed(len(lens))
    perm = torch.randperm(nb, generator=g).tolist()
    tables, slots = [], []
    for n in lens:
        blocks, perm = perm[: -(-n // bs)], perm[-(-n // bs) :]
        tables.append(blocks)
        slots.append(blocks[(n - 1) // bs] * bs + (n - 1) % bs)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens_list=list(lens),
        query_start_list=list(range(len(lens) + 1)),
        num_decodes=len(lens),
        max_seq_len=max(lens),
    )
    return meta, torch.tensor([n - 1 for n in lens], dtype=torch.int64)


def both_paths(core: EngineCore, lens: list[int], kv_dtype: torch.dtype = torch.float32) -> None:
    """One decode-only step with the native loop and with the Python one, from the same
    random caches: hidden states and caches equal, bit for bit."""
    model: LlamaModel = core.runner.model  # type: ignore[union-attr]
    bs = core.runner.block_size  # type: ignore[union-attr]
    nb = core.runner.kv_caches[0][0].shape[0]  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(7)
    caches = [
        (
            torch.randn(k.shape, generator=g).to(kv_dtype),
            torch.randn(v.shape, generator=g).to(kv_dtype),
        )
        for k, v in core.runner.kv_caches  # type: ignore[union-attr]
    ]
    copies = [(k.clone(), v.clone()) for k, v in caches]
    meta, positions = decode_meta(lens, bs, nb)
    ids = torch.tensor([(37 * i + 11) % 200 for i in range(len(lens))])
    cuts: list[int] = []
    with torch.no_grad():
        model.native_decode = False
        want = model.forward(ids, positions, copies, meta)
        model.native_decode = True
        got = model.forward(ids, positions, caches, meta, lambda: cuts.append(1))
    assert model.decode_path == "native"
    assert torch.equal(got, want)
    for (k, v), (kc, vc) in zip(caches, copies, strict=True):
        assert torch.equal(k, kc) and torch.equal(v, vc)
    assert len(cuts) == (len(model.layers) - 1) // llama.CHECK_EVERY  # between segments


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{q}" for f, q in CASES])
def family_engine(request, default_files) -> EngineCore:  # type: ignore[no-untyped-def]
    family, qtype = request.param
    return engine(family_file(family, default_files, qtype))


def test_native_step_equals_python_loop(family_engine: EngineCore) -> None:
    from structllm.kernels.packed import HalfMatrix

    model: LlamaModel = family_engine.runner.model  # type: ignore[assignment]
    if str(family_engine.files.source).endswith("F16.gguf"):  # (not fbgemm's HalfWeight)
        assert all(isinstance(dl.o_proj, HalfMatrix) for dl in model.layers)
    both_paths(family_engine, [13])  # one row (a window of 8 is passed)
    both_paths(family_engine, [1, 40, 9], torch.float16)  # three rows, a float16 cache


def test_mixed_type_matrices_and_greedy_tokens(tmp_path: Path, default_files) -> None:  # type: ignore[no-untyped-def]
    from structllm import LLM, SamplingParams
    from tests.support.models import make_tiny_hf_dir

    hf = make_tiny_hf_dir(  # test_gguf_kquants.py's (whole super-blocks), so cached
        tmp_path,
        default_files,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    try:
        path = llamacpp.quantize(llamacpp.convert_hf(hf, "f32"), "Q4_K_M")
    except llamacpp.ToolMissing as e:
        pytest.skip(str(e))
    llm = LLM(str(path), kv_cache_memory=32 << 20)
    model = llm.engine.runner.model
    kinds = {type(getattr(layer, n)).__name__ for layer in model.layers for n in layer.LINEARS}
    assert "MixedWeight" in kinds  # a q/k/v of Q4_K and Q6_K parts
    both_paths(llm.engine, [5, 17])
    # bad input is refused by name, before anything is written
    plan = model._native_plan()
    meta, _ = decode_meta([5], llm.engine.runner.block_size, 64)
    x, rope = torch.zeros(1, model.cfg.hidden_size), torch.zeros(1, model.cfg.head_dim)
    slots, tables, lens = meta.slot_mapping, meta.block_tables, meta.seq_lens
    with pytest.raises(RuntimeError, match="outside the cache"):
        plan.native.run(0, 1, x, None, [rope], torch.tensor([1 << 40]), tables, lens, 1, 2)
    with pytest.raises(RuntimeError, match="x must be float32"):
        plan.native.run(0, 1, x.double(), None, [rope], slots, tables, lens, 1, 2)
    with pytest.raises(RuntimeError, match="layers 0..99"):
        plan.native.run(0, 99, x, None, [rope], slots, tables, lens, 1, 2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], list(range(100, 137))]
    on = [o.token_ids for o in llm.generate(prompts, params)]
    model.native_decode = False
    off = [o.token_ids for o in llm.generate(prompts, params)]
    assert on == off
    # a q/k/v bias (Qwen2's; llama.cpp's converter cannot write a tiny Qwen2 with this
    # tokenizer): random ones on the mixed q/k/v, the plan built anew
    g = torch.Generator().manual_seed(3)
    for layer in model.layers:
        layer.qkv_bias = torch.randn(layer.qkv_proj.shape[0], generator=g)
    model._decode_plan, model.native_decode = None, True
    both_paths(llm.engine, [5, 17])


@pytest.mark.parametrize(
    ("family", "qtype"),
    [("qwen3_moe", "Q8_0"), ("mixtral", "Q8_0"), ("gpt_oss", "MXFP4_MOE"), ("qwen2_moe", "Q8_0")],
)
def test_experts_run_inside_native_calls(
    family: str,
    qtype: str,
    default_files,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # type: ignore[no-untyped-def]
    # Qwen3-MoE: a dense layer between two MoE ones; Mixtral: every layer MoE, a window;
    # gpt-oss: sinks, o_proj's bias, windows on every other layer (8 tokens: contexts of
    # 13 and 40 reach past them, over several blocks), MXFP4 experts with biases and the
    # clamped SwiGLU, the router's bias and softmax over the top k; Qwen2-MoE: a shared
    # expert beside the routed ones, scaled by its sigmoid gate (set_shared).
    # The router and experts (cpu_moe.cpp) run inside the native calls: no cut after a
    # MoE layer, the segments a dense model's.
    core = engine(family_file(family, default_files, qtype))
    assert "decode steps: the native layer loop" in capfd.readouterr().err  # at start-up
    model: LlamaModel = core.runner.model  # type: ignore[assignment]
    assert any(layer.moe is not None for layer in model.layers)
    both_paths(core, [13])
    both_paths(core, [1, 40, 9], torch.float16)
    plan = model._native_plan()
    n = len(model.layers)
    assert all(
        e is not None
        for dl, e in zip(model.layers, plan.experts, strict=True)
        if dl.moe is not None
    )
    assert len(plan.segments) == -(-n // llama.CHECK_EVERY)
    # experts the native call cannot run (here: made so) run from Python between two
    # native calls, cut after their layer, to the same bits
    monkeypatch.setattr(decode_plan, "_native_experts", lambda dl: None)
    model._decode_plan = None
    both_paths(core, [13])
    both_paths(core, [1, 40, 9], torch.float16)
    plan = model._native_plan()
    assert [end for _, end, _ in plan.segments if plan.cut(end - 1)] == [
        i + 1 for i, dl in enumerate(model.layers) if dl.moe is not None
    ]
    model._decode_plan = None
    if family == "gpt_oss":
        native_and_python_tokens_agree(core, monkeypatch)


def native_and_python_tokens_agree(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens through the engine (a 31-token prompt, 12 more: past the tiny
    window of 8 on the windowed layers) with the native loop, then the Python one
    (which loop ran: the plan's calls counted); the same tokens, logprobs within 1e-4."""
    from structllm import SamplingParams
    from structllm.protocol import AddRequest

    model: LlamaModel = core.runner.model  # type: ignore[assignment]
    native_steps: list[int] = []
    run = decode_plan.DecodePlan.run

    def counted(self: decode_plan.DecodePlan, *a: object) -> torch.Tensor:
        native_steps.append(1)
        return run(self, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_plan.DecodePlan, "run", counted)

    def generate(name: str) -> list[tuple[int, float]]:
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
        core.add_request(AddRequest(name, [(37 * i + 101) % 200 + 3 for i in range(31)], sp))
        out: list[tuple[int, float]] = []
        while core.has_work:
            for d in core.step().outputs:
                lps = d.logprobs or []
                out += [(t, lp.logprob) for t, lp in zip(d.new_token_ids, lps, strict=True)]
        return out

    native = generate("native")
    # (the repeated tokens bring n-gram drafts: those verify steps are not decode-only)
    ran = len(native_steps)
    assert len(native) == 12 and ran >= 1 and model.decode_path == "native"
    model.native_decode = False
    try:
        python = generate("python")
        assert len(native_steps) == ran and model.decode_path == "python"
    finally:
        model.native_decode = True
    assert [t for t, _ in python] == [t for t, _ in native]
    for (_, a), (_, b) in zip(native, python, strict=True):
        assert abs(a - b) <= 1e-4


def test_what_it_cannot_take_keeps_the_python_loop(
    tiny_llama_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # a float checkpoint: float16 weights (fbgemm's HalfWeight) on the fused path
    core = engine(tiny_llama_dir)
    model: LlamaModel = core.runner.model  # type: ignore[assignment]
    assert model.cpu_ops is not None
    err = capfd.readouterr().err
    assert "decode steps: the Python layer loop (qkv_proj is not in GGUF blocks)" in err
    meta, positions = decode_meta([3], core.runner.block_size, core.runner.kv_caches[0][0].shape[0])  # type: ignore[union-attr]
    with torch.no_grad():
        model.forward(torch.tensor([5]), positions, core.runner.kv_caches, meta)  # type: ignore[union-attr]
    assert model.decode_path == "python"
    assert model._native_plan() is None


@pytest.mark.slow
def test_default_model_native_step(default_files) -> None:  # type: ignore[no-untyped-def]
    from structllm import LLM, SamplingParams

    llm = LLM(None, kv_cache_memory=64 << 20)
    both_paths(llm.engine, [30])
    both_paths(llm.engine, [3, 70, 129, 16], torch.float16)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = ["The capital of France is", "def fib(n):"]
    on = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.runner.model.native_decode = False
    off = [o.token_ids for o in llm.generate(prompts, params)]
    assert on == off
