"""A running step is cut short between layers once every request in it is aborted
(``EngineCore.step(pending)``, ``engine.held``), and leaves nothing half-computed behind.

The tiny model has two layers; ``CHECK_EVERY = 1`` makes the engine look for aborts
after the first, so a cut step has written layer 0's K/V and not layer 1's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import structllm.model.llama as llama
from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.engine.held import Held
from structllm.engine.speculative import MIN_MATCH
from structllm.protocol import AddRequest, SamplingParams
from tests.support.models import EXACT

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(1000, 1040))  # 2 full blocks of 16 and a partial one


@pytest.fixture(autouse=True)
def check_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama, "CHECK_EVERY", 1)


def engine(model_dir: Path) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model_dir), kv_cache_memory=8 << 20, max_num_batched_tokens=256, **EXACT
        )
    )


def run_to_end(core: EngineCore, rid: str) -> list[int]:
    tokens: list[int] = []
    while True:
        for d in core.step().outputs:
            if d.request_id == rid:
                tokens += d.new_token_ids
                if d.finish_reason is not None:
                    return tokens


def test_a_step_whose_requests_are_all_aborted_is_cut_short(tiny_llama_dir: Path) -> None:
    core = engine(tiny_llama_dir)
    core.add_request(AddRequest("a", PROMPT, GREEDY))
    core.add_request(AddRequest("b", PROMPT[::-1], GREEDY))
    batch = core.step(lambda: Held({"a", "b"}))
    assert batch.outputs == []  # nothing sampled
    assert (core.num_steps, batch.stats.num_steps_cut) == (0, 1)
    req = core.scheduler.requests["a"]
    assert req.num_computed_tokens == 0  # no request advanced
    # the caller applies the aborts it held: both end, their blocks go back
    core.abort(["a", "b"])
    core.abort(["a", "unknown"])  # gone or never there: not counted again
    batch = core.step()
    finished = {d.request_id: d.finish_reason for d in batch.outputs}
    assert finished == {"a": "abort", "b": "abort"}
    assert batch.stats.num_aborted == 2
    assert core.kv.usage == 0.0


def test_a_step_with_a_request_still_wanted_runs_to_the_end(tiny_llama_dir: Path) -> None:
    core = engine(tiny_llama_dir)
    core.add_request(AddRequest("a", PROMPT, GREEDY))
    core.add_request(AddRequest("b", PROMPT[::-1], GREEDY))
    batch = core.step(lambda: Held({"a"}))  # b is still wanted
    assert (core.num_steps, batch.stats.num_steps_cut) == (1, 0)
    assert {d.request_id for d in batch.outputs if d.new_token_ids} == {"a", "b"}


def test_a_cut_step_leaves_no_half_computed_block_in_the_prefix_cache(
    tiny_llama_dir: Path,
) -> None:
    fresh = engine(tiny_llama_dir)
    fresh.add_request(AddRequest("fresh", PROMPT, GREEDY))
    want = run_to_end(fresh, "fresh")

    core = engine(tiny_llama_dir)
    core.add_request(AddRequest("a", PROMPT, GREEDY))
    core.step(lambda: Held({"a"}))  # cut after layer 0: the prompt's full blocks lack layer 1
    core.abort(["a"])
    core.step()
    # the same prompt again: a hit on those blocks would attend to layer 1's zeros
    core.add_request(AddRequest("again", PROMPT, GREEDY))
    assert run_to_end(core, "again") == want
    assert core.kv.num_hit_tokens == 0


def test_a_cut_step_with_drafts_drops_them_and_caches_nothing_of_it(tiny_llama_dir: Path) -> None:
    """Speculative decoding: a decode step carrying drafts, cut short, drops the drafts;
    the aborts then free everything, and no block of the cut step stays cached."""
    from structllm.config import SpeculativeConfig

    core = engine(tiny_llama_dir)
    core.set_speculative(SpeculativeConfig(num_speculative_tokens=3, max_step_tokens=64))
    drafter = core.scheduler.drafter
    assert drafter is not None

    class Fixed:
        last_match = MIN_MATCH  # drafts as if from a long match

        def propose(self, req: object, k: int) -> list[int]:
            return [5, 6, 7][:k]

        def finish(self, req: object) -> None:
            pass

    drafter.proposer = Fixed()
    core.add_request(AddRequest("a", PROMPT, GREEDY))
    core.step()  # the prompt; "a" now decodes
    cached = dict(core.kv.cached)
    scheduled: list[int] = []
    execute = core.runner.execute

    def recording(sched, between_layers=None):  # type: ignore[no-untyped-def]
        scheduled.extend(n for _, n in sched.scheduled)
        return execute(sched, between_layers)

    core.runner.execute = recording  # type: ignore[method-assign]
    batch = core.step(lambda: Held({"a"}))
    assert scheduled == [4]  # the newest token and 3 drafts
    assert batch.outputs == [] and batch.stats.num_steps_cut == 1
    req = core.scheduler.requests["a"]
    assert req.draft_token_ids == []
    core.abort(["a"])
    assert {d.request_id: d.finish_reason for d in core.step().outputs} == {"a": "abort"}
    assert core.kv.usage == 0.0
    assert core.kv.cached == cached  # the cut step registered nothing that stayed
    assert drafter.stats.num_drafts == 0  # nothing was verified
