"""Short steps: the CPU's default token budget (a pure rule over a measured cost), and
aborts that arrive during a step landing before the next one is scheduled."""

from __future__ import annotations

import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.engine.null import NullRunner
from structllm.engine.process import engine_loop
from structllm.engine.scheduler import SchedulerOutput
from structllm.engine.step_budget import (
    GRANULE,
    MAX_AUTO_TOKENS,
    MIN_AUTO_TOKENS,
    TARGET_STEP_S,
    auto_token_budget,
    budget_upper_bound,
)
from structllm.ipc.channel import Doorbell, Endpoint, SpinBudget
from structllm.ipc.ring import Ring, ring_size
from structllm.protocol import (
    Abort,
    AddRequest,
    FromEngine,
    OutputBatch,
    SamplingParams,
    Shutdown,
    ToEngine,
    TokenLogprobs,
)

# -- the rule ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ms_per_token", "max_num_seqs", "expected"),
    [
        (1.6, 16, 112),  # a 2-core AVX2 machine, the default model: 125 fit, on the grid
        (3.6, 16, 64),  # a slower one: 55 fit; the floor
        (1.2, 16, 160),  # 166 fit, on the grid
        (3.6, 128, 128),  # never below max_num_seqs: every running decode fits one step
        (0.02, 16, MAX_AUTO_TOKENS),  # a fast machine: the cap (10000 would fit)
        (0.1, 16, 2000 // GRANULE * GRANULE),
        (50.0, 1, MIN_AUTO_TOKENS),  # a very slow one (or a noisy start): the floor, not 4 tokens
        (0.05, 4096, 4096),  # max_num_seqs above the cap wins
        (0.0, 16, MAX_AUTO_TOKENS),  # nothing measured
    ],
)
def test_auto_budget_rule(ms_per_token: float, max_num_seqs: int, expected: int) -> None:
    assert auto_token_budget(ms_per_token / 1000, max_num_seqs) == expected


def test_auto_budget_keeps_a_step_near_the_target() -> None:
    for us in range(5, 5000, 7):  # seconds per token from 5 us to 5 ms
        spt = us * 1e-6
        b = auto_token_budget(spt, 1)
        assert b % GRANULE == 0 and MIN_AUTO_TOKENS <= b <= MAX_AUTO_TOKENS
        if (
            MIN_AUTO_TOKENS < b < MAX_AUTO_TOKENS
        ):  # not clamped: within one granule under the target
            assert TARGET_STEP_S - GRANULE * spt < b * spt <= TARGET_STEP_S
        assert auto_token_budget(spt, 1) == b  # deterministic


def test_auto_budget_is_monotone_in_the_cost() -> None:
    budgets = [auto_token_budget(us * 1e-6, 8) for us in range(10, 3000, 10)]
    assert budgets == sorted(budgets, reverse=True)


def test_budget_bounds() -> None:
    with pytest.raises(ValueError):
        auto_token_budget(1e-3, 0)
    assert budget_upper_bound(None, 16) == MAX_AUTO_TOKENS
    assert budget_upper_bound(None, 5000) == 5000
    assert budget_upper_bound(64, 5000) == 64
    with pytest.raises(ValueError):
        EngineConfig(max_num_batched_tokens=0)


def test_configured_budget_is_kept_and_null_model_gets_the_default() -> None:
    core = EngineCore(
        EngineConfig(null_model=True, kv_cache_memory=16 << 20, max_num_batched_tokens=48)
    )
    assert core.scheduler.max_num_batched_tokens == 48
    core = EngineCore(EngineConfig(null_model=True, kv_cache_memory=16 << 20, max_num_seqs=4))
    assert core.scheduler.max_num_batched_tokens == MAX_AUTO_TOKENS


def test_cpu_engine_measures_its_budget_and_leaves_no_trace(tiny_llama_dir: Path) -> None:
    core = EngineCore(
        EngineConfig(
            model=str(tiny_llama_dir), kv_cache_memory=16 << 20, max_num_seqs=8, device="cpu"
        )
    )
    try:
        b = core.scheduler.max_num_batched_tokens
        assert b == core.max_num_batched_tokens
        assert b % GRANULE == 0 and MIN_AUTO_TOKENS <= b <= MAX_AUTO_TOKENS
        # the probe forward passes are not steps, requests, cache entries or statistics
        s = core.stats()
        assert (s.num_steps, s.num_prompt_tokens, s.prefix_cache_queries, s.kv_cache_usage) == (
            0,
            0,
            0,
            0.0,
        )
        assert core.kv.num_free_blocks == core.num_blocks
        assert not core.kv.cached and all(k is None for k in core.kv.block_key)
    finally:
        core.close()


# -- aborts land between steps ------------------------------------------------------------


class GatedRunner(NullRunner):
    """A ``NullRunner`` whose every step waits for the test: it reports which requests
    the step carries, then blocks until released. So the test can act *during* a step."""

    def __init__(self) -> None:
        super().__init__()
        self.entered: queue.Queue[set[str]] = queue.Queue()
        self.release = threading.Semaphore(0)

    def execute(
        self, sched: SchedulerOutput, between_layers: Callable[[], None] | None = None
    ) -> tuple[dict[str, int], dict[str, TokenLogprobs], dict[str, list[TokenLogprobs]]]:
        self.entered.put({r.request_id for r, _ in sched.scheduled})
        assert self.release.acquire(timeout=60), "the test never released the step"
        if between_layers is not None:
            between_layers()  # one look for aborts, after the test acted
        return super().execute(sched, between_layers)


def channel(mapping: mmap.mmap, capacity: int, i: int) -> tuple[Ring, Ring]:
    base = 2 * i * ring_size(capacity)
    return Ring(mapping, capacity, base, True), Ring(
        mapping, capacity, base + ring_size(capacity), True
    )


@pytest.fixture
def gated_engine() -> Iterator[tuple[GatedRunner, list[Endpoint[FromEngine]]]]:
    """``engine_loop`` on a thread over two in-process channels, with a gated runner."""
    capacity, n = 1 << 16, 2
    mapping = mmap.mmap(-1, 2 * n * ring_size(capacity))
    engine_bell = Doorbell()
    fronts: list[Endpoint[FromEngine]] = []
    engines: list[Endpoint[ToEngine]] = []
    for i in range(n):
        to_engine, to_front = channel(mapping, capacity, i)
        front_bell = Doorbell()
        engines.append(Endpoint(to_engine, to_front, engine_bell, front_bell, ToEngine))
        fronts.append(Endpoint(to_front, to_engine, front_bell, engine_bell, FromEngine))
    core = EngineCore(EngineConfig(null_model=True, kv_cache_memory=16 << 20))
    runner = GatedRunner()
    core.runner = runner
    parent_r, parent_w = os.pipe()  # never written: the "parent" stays
    exit_code: list[int] = []
    loop = threading.Thread(
        target=lambda: exit_code.append(
            engine_loop(core, engines, parent_r, os.getppid(), SpinBudget(0.0))
        )
    )
    loop.start()
    try:
        yield runner, fronts
    finally:
        fronts[0].send_blocking(Shutdown())
        for _ in range(100):  # let any step in flight finish
            runner.release.release()
        loop.join(timeout=60)
        assert exit_code == [0]
        for fd in (parent_r, parent_w):
            os.close(fd)


def next_batch(ep: Endpoint[FromEngine]) -> OutputBatch:
    while True:
        msgs = ep.try_recv(limit=1)
        if msgs:
            assert isinstance(msgs[0], OutputBatch)
            return msgs[0]
        ep.wait(1.0)


def test_an_abort_sent_during_a_step_lands_before_the_next_step(
    gated_engine: tuple[GatedRunner, list[Endpoint[FromEngine]]],
) -> None:
    runner, fronts = gated_engine
    long = SamplingParams(max_tokens=1000, ignore_eos=True)
    fronts[0].send_blocking(AddRequest("a", [1, 2, 3], long))
    fronts[1].send_blocking(AddRequest("b", [4, 5, 6], long))
    entered = 0  # steps the engine has started

    def wait_step() -> set[str]:
        nonlocal entered
        ids = runner.entered.get(timeout=60)
        entered += 1
        return ids

    while wait_step() != {"a", "b"}:  # until a step carries both
        runner.release.release()
    in_flight = entered  # this step is running now (blocked in the runner)
    # Several front-end messages arrive during it: the abort of "a" on the second
    # channel, behind other traffic on both.
    fronts[0].send_blocking(AddRequest("c", [7, 8], long))
    fronts[1].send_blocking(AddRequest("d", [9], long))
    fronts[1].send_blocking(Abort(["a", "d"]))
    runner.release.release()
    after = wait_step()
    assert "a" not in after and "d" not in after, (
        "an abort that arrived during a step was not applied before the next"
    )
    assert after == {"b", "c"}  # everything else that arrived was taken in, too
    runner.release.release()
    # "a" had its token from the step the abort arrived in, and its abort is reported
    # with the batch of the very next step.
    while True:
        batch = next_batch(fronts[0])
        mine = [d for d in batch.outputs if d.request_id == "a"]
        if any(d.finish_reason == "abort" for d in mine):
            break
        assert batch.stats.num_steps <= in_flight
    assert batch.stats.num_steps == in_flight + 1
    assert all(not d.new_token_ids for d in mine)
