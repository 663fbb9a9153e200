"""Hybrid models (recurrent layers beside attention, ``engine.state_cache``) through the
engine, on the tiny LFM2 checkpoint: whatever way a request's tokens are cut into steps
(chunk sizes, mixed batches, preemption, aborts around it) its greedy tokens are those of
one uninterrupted run, and the state slots come back when requests end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from structllm import LLM, SamplingParams
from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.engine.held import Held
from structllm.engine.request import Request
from structllm.engine.state_cache import StateCacheManager
from structllm.model.hybrid import RecurrentLayer
from structllm.model.llama import DecoderLayer
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
def uncached(path: Path) -> LLM:
    """The reference: one request at a time, its prompt in one step, no prefix caching."""
    return LLM(
        str(path), kv_cache_memory=32 << 20, max_num_seqs=1, enable_prefix_caching=False, **EXACT
    )


@pytest.fixture(scope="module")
def alone(uncached: LLM) -> list[Run]:
    """Each prompt's tokens run alone, its prompt in one step."""
    return [run_of(uncached.generate([p], GREEDY)[0]) for p in PROMPTS]


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
    # four slots, the saved states they bring (prefix caching), six blocks: 96 tokens
    fits = [s for s in range(9) if min(8, ((4 + s) * slot + 6 * block) // 4 // slot) == s]
    memory = (4 + fits[0]) * slot + 6 * block
    llm = LLM(str(path), kv_cache_memory=memory, block_size=16, max_num_seqs=4, **EXACT)
    engine = llm.engine
    assert engine.num_blocks < 12, "the cache should be too small for every prompt at once"
    got = [run_of(o) for o in llm.generate(PROMPTS, GREEDY)]
    assert engine.scheduler.num_preemptions > 0
    assert_same(got, alone)
    # again, with prefix caching (on by default): hits, preemptions, still the same
    preempted = engine.scheduler.num_preemptions
    assert_same([run_of(o) for o in llm.generate(PROMPTS, GREEDY)], alone)
    assert engine.scheduler.num_preemptions > preempted
    assert engine.states is not None and engine.states.num_free_slots == engine.states.num_slots


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
    # a row per slot and per saved state (prefix caching: two per slot where they fit)
    assert slot * small.states.num_rows == sum(t.numel() * t.element_size() for t in held)
    assert small.states.num_slots == 4
    assert small.states.num_saved == min(8, (1 << 20) // 4 // slot)
    assert big.states.num_slots == min(64, (1 << 20) // 2 // slot)
    assert big.num_blocks < small.num_blocks  # the more slots came out of the blocks


def test_native_decode_steps_equal_torch_ops(path: Path) -> None:
    # the default format (fused CPU ops): decode rows and prefill chunks (saved states
    # at block boundaries included) through cpu_recurrent.cpp, or, with the kernels taken
    # away, through torch's ops; the same tokens and logprobs
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


def counting(fn: Callable[..., object], calls: list[int]) -> Callable[..., object]:
    """``fn`` that appends to ``calls`` each time it runs."""

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return fn(*args, **kwargs)

    return counted


def test_the_fused_layer_loop_equals_the_plain_one(path: Path) -> None:
    # the default format (fused CPU ops): the layers through cpu_layer.cpp's norms,
    # residual adds, rotary + KV store and SiLU * up, or through the plain torch loop
    # the exact path runs; chunked prefills beside decodes, the same tokens and logprobs
    runs = []
    for fused in (True, False):
        llm = LLM(str(path), kv_cache_memory=32 << 20, max_num_batched_tokens=16)
        model = llm.engine.runner.model  # type: ignore[union-attr]
        if model.cpu_ops is None:
            pytest.skip("the fused CPU layer ops do not build here")
        model.fused_layers = fused
        # a layer with a fused form (Nemotron-H's blocks and layers with experts have
        # none: they run their own forward on both loops) runs its plain forward on the
        # plain loop only
        layer = next(
            (
                x
                for x in model.layers
                if (type(x) is DecoderLayer or isinstance(x, RecurrentLayer)) and x.moe is None
            ),
            None,
        )
        calls: list[int] = []
        if layer is not None:
            layer.forward = counting(layer.forward, calls)  # type: ignore[method-assign]
        runs.append([run_of(o) for o in llm.generate(PROMPTS, GREEDY)])
        assert bool(calls) == (not fused and layer is not None)
    assert_same(runs[0], runs[1])


# -- prefix caching: recurrent states saved at block boundaries (engine.state_cache) --

BLOCK = 16
# where a repeat of each prompt resumes: its last full block before its last token
REPEAT = [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]


def cached_llm(path: Path, chunk: int, **kw: object) -> LLM:
    return LLM(
        str(path),
        kv_cache_memory=kw.pop("kv_cache_memory", 32 << 20),
        block_size=BLOCK,
        max_num_batched_tokens=chunk,
        **kw,
        **EXACT,
    )


def test_a_chunk_saves_the_state_at_its_boundary_within_the_step() -> None:
    # a 10-row chunk saving 4 rows in: the saved row holds the window after row 4, the
    # slot the window after row 10, the output is the unsaved chunk's
    from structllm.model.recurrent import RecurrentBatch, causal_conv1d

    torch.manual_seed(0)
    x, w = torch.randn(10, 6), torch.randn(6, 3)
    fresh = [True]

    def batch(saves: tuple[tuple[int, int, int], ...]) -> RecurrentBatch:
        slots = torch.tensor([0])
        return RecurrentBatch([0, 10], [0], slots, fresh, torch.tensor(fresh), 0, None, saves)

    plain, saved = torch.zeros(3, 6, 2), torch.zeros(3, 6, 2)
    want = causal_conv1d(x, w, None, plain, batch(()))
    got = causal_conv1d(x, w, None, saved, batch(((0, 4, 2),)))
    head = torch.zeros(1, 6, 2)
    four = RecurrentBatch([0, 4], [0], torch.tensor([0]), fresh, torch.tensor(fresh), 0)
    causal_conv1d(x[:4], w, None, head, four)
    assert torch.equal(got, want) and torch.equal(saved[0], plain[0])
    assert torch.equal(saved[2], head[0])
    with pytest.raises(ValueError, match="saved 11 rows into a 10-row chunk"):
        causal_conv1d(x, w, None, saved, batch(((0, 11, 2),)))


@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_a_prefix_cache_hit_equals_an_uncached_run(
    path: Path, alone: list[Run], chunk: int, capfd: pytest.CaptureFixture[str]
) -> None:
    llm = cached_llm(path, chunk)
    assert "prefix caching: on (a hybrid model" in capfd.readouterr().err
    # together (mixed batches, states saved as chunks pass boundaries), then alone
    assert_same([run_of(o) for o in llm.generate(PROMPTS, GREEDY)], alone)
    hits = []
    for _ in range(2):
        outs = [llm.generate([p], GREEDY)[0] for p in PROMPTS]
        assert_same([run_of(o) for o in outs], alone)
        hits.append([o.num_cached_tokens for o in outs])
    # never past the repeat point; once a prompt has run alone, exactly there
    assert all(h <= r and h % BLOCK == 0 for h, r in zip(hits[0], REPEAT, strict=True))
    assert hits[1] == REPEAT
    engine = llm.engine
    assert engine.kv.num_hit_tokens == sum(hits[0]) + sum(hits[1])  # /metrics' counter
    assert engine.states is not None and not engine.states.pending


def test_a_shared_prefix_resumes_at_its_last_saved_block_not_past_it(
    path: Path, uncached: LLM
) -> None:
    base = PROMPTS[2]  # 58 tokens
    two = base[:42] + list(range(3000, 3020))  # 2 full blocks and 10 tokens shared
    three = base[:50] + list(range(3100, 3110))  # 3 full blocks and 2 tokens
    want = [run_of(uncached.generate([p], GREEDY)[0]) for p in (two, three)]
    # 16-token chunks save at every boundary (16, 32, 48): each resumes at its last
    # shared block; one chunk saves only at 48: the 2-block sharer resumes nowhere
    for chunk, hits in ((16, [32, 48]), (256, [0, 48])):
        llm = cached_llm(path, chunk)
        llm.generate([base], GREEDY)
        outs = [llm.generate([p], GREEDY)[0] for p in (two, three)]
        assert_same([run_of(o) for o in outs], want)
        assert [o.num_cached_tokens for o in outs] == hits
        assert llm.engine.kv.num_hit_tokens == sum(hits)


def test_saved_states_evicted_under_memory_pressure_leave_outputs_exact(
    path: Path, alone: list[Run]
) -> None:
    # one slot, at most two saved states, a few KV blocks: states go with their blocks
    # and to newer saves, and whatever is resumed is exact
    probe = cached_llm(path, 256, kv_cache_memory=1 << 20).engine
    block = BLOCK * 4 * probe.files.config.kv_bytes_per_token
    memory = 4 * probe.state_slot_bytes + 8 * block
    llm = cached_llm(path, 16, kv_cache_memory=memory, max_num_seqs=1)
    engine = llm.engine
    states = engine.states
    assert states is not None and states.num_slots == 1 and states.num_saved in (1, 2)
    hits = 0
    for _ in range(2):
        outs = llm.generate(PROMPTS, GREEDY)
        assert_same([run_of(o) for o in outs], alone)
        hits += sum(o.num_cached_tokens for o in outs)
        cached = [engine.kv.block_chain_id[b] for b in engine.kv.cached.values()]
        states.check_invariants([], cached)
    assert hits < sum(REPEAT)  # some states went before they were hit
    assert engine.kv.num_hit_tokens == hits


def test_a_hit_after_an_abort_mid_prefill_and_a_step_cut_short(
    path: Path, alone: list[Run], monkeypatch: pytest.MonkeyPatch
) -> None:
    import structllm.model.hybrid as hybrid

    monkeypatch.setattr(hybrid, "CHECK_EVERY", 1)  # the engine looks after every layer
    engine = EngineCore(
        EngineConfig(
            model=str(path),
            kv_cache_memory=32 << 20,
            block_size=BLOCK,
            max_num_batched_tokens=20,
            **EXACT,  # type: ignore[arg-type]
        )
    )
    states = engine.states
    assert states is not None
    engine.add_request(AddRequest("gone", PROMPTS[2], GREEDY))
    engine.step()  # 0..20: the state at 16 saved
    engine.step(lambda: Held({"gone"}))  # 20..40 cut short: the save at 32 never written
    assert engine.num_steps_cut == 1 and not states.pending
    engine.abort(["gone"])
    engine.step()
    engine.add_request(AddRequest("again", PROMPTS[2], GREEDY))
    run: Run = []
    cached = -1
    for _ in range(200):
        if not engine.has_work:
            break
        for d in engine.step().outputs:
            cached = d.num_cached_tokens
            lps = d.logprobs or []
            run += [
                (t, [lp.logprob, *lp.top_logprobs])
                for t, lp in zip(d.new_token_ids, lps, strict=True)
            ]
    assert cached == 16
    assert_same([run], [alone[2]])


def test_the_state_rows_return_to_idle_after_a_storm_of_aborts(
    path: Path, alone: list[Run]
) -> None:
    engine = EngineCore(
        EngineConfig(
            model=str(path),
            kv_cache_memory=32 << 20,
            block_size=BLOCK,
            max_num_batched_tokens=24,
            **EXACT,  # type: ignore[arg-type]
        )
    )
    states = engine.states
    assert states is not None
    ids = [f"r{i}" for i in range(12)]
    for i, rid in enumerate(ids):  # sharing heads: hits on states saved by the others
        engine.add_request(AddRequest(rid, PROMPTS[i % 4] + [9] * i, GREEDY))
    for k in range(6):  # aborted in waves, mid-prefill and mid-decode
        engine.step()
        engine.abort(ids[2 * k : 2 * k + 2])
    while engine.has_work:
        engine.step()
    assert states.num_free_slots == states.num_slots
    assert not states.pending and not states.dead
    cached = [engine.kv.block_chain_id[b] for b in engine.kv.cached.values()]
    states.check_invariants([], cached)
    assert engine.kv.usage == 0.0
    engine.kv.reset_prefix_cache()  # the cached blocks go, and the states with them
    assert not states.saved and states.num_saved_used == 0
    # and the engine still answers exactly
    engine.add_request(AddRequest("after", PROMPTS[0], GREEDY))
    tokens: list[int] = []
    while engine.has_work:
        for d in engine.step().outputs:
            tokens += d.new_token_ids
    assert tokens == [t for t, _ in alone[0]]
