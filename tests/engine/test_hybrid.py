"""Hybrid models (recurrent layers beside attention, ``engine.state_cache``) through the
engine, on the tiny LFM2 checkpoint: whatever way a request's tokens are cut into steps
(chunk sizes, mixed batches, preemption, aborts around it) its greedy tokens are those of
one uninterrupted run, and the state slots come back when requests end."""

from __future__ import annotations

from pathlib import Path

import pytest

from structllm import LLM, SamplingParams
from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.engine.request import Request
from structllm.engine.state_cache import StateCacheManager
from structllm.protocol import AddRequest
from tests.support.models import EXACT, tiny_family_dir

PROMPTS = [list(range(100, 137)), [7, 8, 9], list(range(500, 900, 7)), [5] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
Run = list[tuple[int, list[float]]]  # per output token: the token, its top logprobs


def run_of(out: object) -> Run:
    """A request's tokens and their top logprobs (a state carried wrongly moves the
    logprobs even where the tiny model's greedy tokens would not change)."""
    return [
        (t, [lp.logprob, *lp.top_logprobs])
        for t, lp in zip(out.token_ids, out.logprobs, strict=True)
    ]  # type: ignore[attr-defined]


def assert_same(got: list[Run], want: list[Run]) -> None:
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in want]
    for g, w in zip(got, want, strict=True):
        for (_, a), (_, b) in zip(g, w, strict=True):
            assert a == pytest.approx(b, abs=1e-4)


@pytest.fixture(
    scope="module",
    params=["lfm2", "qwen3_5", "qwen3_5_moe", "qwen3_next", "granitemoehybrid", "nemotron_h"],
)
def path(request, default_files) -> Path:  # type: ignore[no-untyped-def]
    return tiny_family_dir(request.param, default_files)


@pytest.fixture(scope="module")
def alone(path: Path) -> list[Run]:
    """Each prompt's tokens run alone, its prompt in one step."""
    llm = LLM(str(path), kv_cache_memory=32 << 20, max_num_seqs=1, **EXACT)
    return [run_of(llm.generate([p], GREEDY)[0]) for p in PROMPTS]


def test_a_slot_is_held_while_running_and_given_back() -> None:
    states = StateCacheManager(2)
    a, b, c = (Request(r, [1, 2], GREEDY, 4) for r in "abc")
    assert states.allocate(a) and states.allocate(b) and not states.allocate(c)
    assert {a.state_slot, b.state_slot} == {0, 1} and c.state_slot == -1
    states.check_invariants([a, b, c])
    states.free_slot(a)
    assert states.allocate(c) and c.state_slot == 0
    states.free_slot(b)
    states.free_slot(b)  # twice: nothing more
    assert states.num_free_slots == 1
    states.check_invariants([a, b, c])


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_prefill_and_mixed_batches_equal_one_pass(
    path: Path, alone: list[Run], chunk: int
) -> None:
    # every prompt at once: decode rows of some sequences beside prefill chunks of others
    llm = LLM(str(path), kv_cache_memory=32 << 20, max_num_batched_tokens=chunk, **EXACT)
    assert_same([run_of(o) for o in llm.generate(PROMPTS, GREEDY)], alone)
    states = llm.engine.states
    assert states is not None and states.num_free_slots == states.num_slots


def test_preemption_recomputes_exactly(path: Path, alone: list[Run]) -> None:
    # a KV cache of a few blocks: the newest running request is preempted (its slot
    # given back) and recomputed from its first token later
    probe = LLM(str(path), kv_cache_memory=1 << 20, **EXACT).engine
    cfg, slot = probe.files.config, probe.state_slot_bytes
    block = 16 * 4 * cfg.kv_bytes_per_token  # float32
    memory = 4 * slot + 6 * block  # a few slots, six blocks or more: 96+ tokens
    llm = LLM(str(path), kv_cache_memory=memory, block_size=16, max_num_seqs=4, **EXACT)
    engine = llm.engine
    assert engine.num_blocks < 12, "the cache should be too small for every prompt at once"
    got = [run_of(o) for o in llm.generate(PROMPTS, GREEDY)]
    assert engine.scheduler.num_preemptions > 0
    assert_same(got, alone)


def test_an_abort_mid_prefill_frees_the_slot_and_disturbs_no_one(
    path: Path, alone: list[Run]
) -> None:
    engine = EngineCore(
        EngineConfig(model=str(path), kv_cache_memory=32 << 20, max_num_batched_tokens=8, **EXACT)  # type: ignore[arg-type]
    )
    states = engine.states
    assert states is not None
    engine.add_request(AddRequest("gone", PROMPTS[2], GREEDY))
    engine.add_request(AddRequest("kept", PROMPTS[0], GREEDY))
    engine.step()  # "gone" is part-way through its 58-token prompt
    assert states.num_slots - states.num_free_slots == 1
    engine.abort(["gone"])
    engine.add_request(AddRequest("again", PROMPTS[2], GREEDY))  # reuses the slot
    runs: dict[str, Run] = {"kept": [], "again": []}
    for _ in range(200):
        if not engine.has_work:
            break
        for d in engine.step().outputs:
            if d.request_id in runs:
                lps = d.logprobs or []
                runs[d.request_id] += [
                    (t, [lp.logprob, *lp.top_logprobs])
                    for t, lp in zip(d.new_token_ids, lps, strict=True)
                ]
    assert_same([runs["kept"], runs["again"]], [alone[0], alone[2]])
    assert states.num_free_slots == states.num_slots
    states.check_invariants(list(engine.scheduler.requests.values()))


def test_prefix_caching_is_off_and_says_so(
    path: Path, alone: list[Run], capfd: pytest.CaptureFixture[str]
) -> None:
    llm = LLM(str(path), kv_cache_memory=32 << 20, **EXACT)
    assert "prefix caching: off (a hybrid model" in capfd.readouterr().err
    for _ in range(2):  # the same prompt twice: computed twice, the same tokens
        assert_same([run_of(llm.generate([PROMPTS[2]], GREEDY)[0])], [alone[2]])
    assert llm.engine.kv.num_hit_tokens == 0


def test_speculative_decoding_is_refused_by_name(path: Path) -> None:
    with pytest.raises(
        ValueError,
        match="speculative decoding is not supported for (lfm2|qwen3_|granite|nemotron_h)",
    ):
        LLM(str(path), speculative_config={"method": "ngram"}, **EXACT)


def test_tensor_parallelism_is_refused_by_name(path: Path) -> None:
    with pytest.raises(
        ValueError, match="(lfm2|qwen3_|granitemoehybrid|nemotron_h)[a-z0-9_]* is a hybrid model"
    ):
        EngineCore(EngineConfig(model=str(path), tensor_parallel_size=2, **EXACT))  # type: ignore[arg-type]


def test_state_slots_share_the_cache_budget(path: Path) -> None:
    small = LLM(str(path), kv_cache_memory=1 << 20, max_num_seqs=4, **EXACT).engine
    big = LLM(str(path), kv_cache_memory=1 << 20, max_num_seqs=64, **EXACT).engine
    assert small.states is not None and big.states is not None
    slot = small.state_slot_bytes
    if small.files.config.architecture == "lfm2":  # three conv layers' [64, 2] windows
        assert slot == 3 * 64 * 2 * 4
    if small.files.config.architecture == "nemotron_h":  # three Mamba-2 layers' states:
        # a [160, 3] window and [4, 32, 8] scan state each; the MLP-only layers none
        assert slot == 3 * (160 * 3 + 4 * 32 * 8) * 4
        assert [len(c) for c in small.runner.kv_caches] == [2, 0, 2, 2, 0, 2]
    # the states (an MLP-only layer's entry: empty, neither K/V nor a state)
    held = [t for c in small.runner.kv_caches if c and c[0].dim() == 3 for t in c]
    assert slot * small.states.num_slots == sum(t.numel() * t.element_size() for t in held)
    assert small.states.num_slots == 4
    assert big.states.num_slots == min(64, (1 << 20) // 2 // slot)
    assert big.num_blocks < small.num_blocks  # the more slots came out of the blocks


def test_native_decode_steps_equal_torch_ops(path: Path) -> None:
    # the default format (fused CPU ops): decode rows through cpu_recurrent.cpp, or, with
    # the kernels taken away, through torch's ops; the same tokens and logprobs
    from structllm.kernels import cpu_ext

    if cpu_ext.load_recurrent() is None:
        pytest.skip("the recurrent decode kernels do not build here")
    runs = []
    for native in (True, False):
        llm = LLM(str(path), kv_cache_memory=32 << 20, max_num_batched_tokens=16)
        model = llm.engine.runner.model  # type: ignore[union-attr]
        assert model.cpu_ops is not None
        if not native:
            model._recurrent = False  # as if the kernels had not built
        runs.append([run_of(o) for o in llm.generate(PROMPTS, GREEDY)])
        assert (model._recurrent is not False) == native
    assert_same(runs[0], runs[1])
