"""The priority scheduling policy through the engine (tiny exact float32 Llama): an
urgent request takes a full batch's seat within one step, the request it preempted
resumes and loses nothing, an urgent arrival read mid-step cuts that step and then
prefills alone, and the offline API takes vLLM's ``priority`` argument."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

import structllm.model.llama as llama
from structllm import LLM
from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.engine.held import Held
from structllm.protocol import AddRequest, OutputBatch, SamplingParams
from tests.support.models import EXACT

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = {
    "low0": list(range(1000, 1040)),
    "low1": list(range(2000, 2030)),
    "urgent": list(range(3000, 3020)),
}


def collect(batch: OutputBatch, tokens: dict[str, list[int]]) -> set[str]:
    """Add the batch's tokens to ``tokens``; the ids that finished."""
    done = set()
    for d in batch.outputs:
        assert d.error is None, d.error
        tokens[d.request_id] += d.new_token_ids
        if d.finish_reason is not None:
            done.add(d.request_id)
    return done


@pytest.fixture(scope="module")
def fcfs(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), kv_cache_memory=8 << 20, max_num_batched_tokens=256, **EXACT)


def test_an_urgent_request_starts_within_one_step_of_a_full_batch(
    tiny_llama_dir: Path, fcfs: LLM
) -> None:
    core = EngineCore(
        EngineConfig(
            model=str(tiny_llama_dir),
            kv_cache_memory=8 << 20,
            max_num_batched_tokens=256,
            max_num_seqs=2,
            scheduling_policy="priority",
            **EXACT,
        )
    )
    tokens: dict[str, list[int]] = defaultdict(list)
    for rid in ("low0", "low1"):
        core.add_request(AddRequest(rid, PROMPTS[rid], GREEDY, priority=5))
    collect(core.step(), tokens)
    collect(core.step(), tokens)  # both decoding: the batch is full
    core.add_request(AddRequest("urgent", PROMPTS["urgent"], GREEDY, priority=-1))
    batch = core.step()
    collect(batch, tokens)
    assert len(tokens["urgent"]) == 1  # its prompt ran and sampled in this very step
    assert [r.request_id for r in core.scheduler.waiting] == ["low1"]  # the later equal
    assert batch.stats.num_preemptions == 1
    assert batch.stats.num_waiting_by_priority == {5: 1}
    done: set[str] = set()
    for _ in range(3 * GREEDY.max_tokens + 5):
        done |= collect(core.step(), tokens)
        if len(done) == 3:
            break
    assert core.scheduler.num_preemptions == 1  # the preempted one never preempts back
    alone = fcfs.generate(list(PROMPTS.values()), GREEDY)
    assert dict(tokens) == {rid: out.token_ids for rid, out in zip(PROMPTS, alone, strict=True)}
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_fcfs_refuses_a_priority_with_vllm_s_message(fcfs: LLM) -> None:
    with pytest.raises(ValueError, match="Got priority 3 but Priority scheduling is not enabled"):
        fcfs.generate([PROMPTS["low0"]], GREEDY, priority=[3])
    out = fcfs.generate([PROMPTS["low0"]], GREEDY, priority=[0])  # 0 is everyone's
    assert len(out[0].token_ids) == GREEDY.max_tokens
    fcfs.engine.add_request(AddRequest("x", PROMPTS["low0"], GREEDY, priority=1))
    [delta] = fcfs.engine.step().outputs
    assert delta.finish_reason == "error"
    assert delta.error == "Got priority 1 but Priority scheduling is not enabled."
    with pytest.raises(ValueError, match="priority has 2 values for 1 prompts"):
        fcfs.generate([PROMPTS["low0"]], GREEDY, priority=[0, 0])


def test_offline_priority_orders_a_one_seat_engine(
    tiny_llama_dir: Path, fcfs: LLM, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    llm = LLM(
        str(tiny_llama_dir),
        kv_cache_memory=8 << 20,
        max_num_batched_tokens=256,
        max_num_seqs=1,
        scheduling_policy="priority",
        trace=str(trace),
        **EXACT,
    )
    prompts = list(PROMPTS.values())
    outs = llm.generate(prompts, GREEDY, priority=[2, 0, 1])
    assert llm.engine.scheduler.num_preemptions == 0  # queued by priority, none displaced
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    finished = [e["args"]["request_id"] for e in events if e["name"] == "finished"]
    order = list(dict.fromkeys(finished))  # engine and output processor both say so
    assert order == [f"{outs[i].request_id}-0" for i in (1, 2, 0)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in fcfs.generate(prompts, GREEDY)]


def priority_core(model_dir: Path, max_num_seqs: int, policy: str = "priority") -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            kv_cache_memory=8 << 20,
            max_num_batched_tokens=256,
            max_num_seqs=max_num_seqs,
            scheduling_policy=policy,
            **EXACT,
        )
    )


def test_an_urgent_arrival_cuts_the_step_and_its_prefill_runs_alone(
    tiny_llama_dir: Path, fcfs: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine loop peeks at its ring between layers (``CHECK_EVERY = 1``: after the
    tiny model's first): an arrival strictly more urgent than every request of the step
    cuts it (nothing sampled, nobody advances), and the next step is its prefill alone,
    which samples its first token. The paused requests then finish with the tokens of
    an uninterrupted run."""
    monkeypatch.setattr(llama, "CHECK_EVERY", 1)
    core = priority_core(tiny_llama_dir, 4)
    tokens: dict[str, list[int]] = defaultdict(list)
    for rid in ("low0", "low1"):
        core.add_request(AddRequest(rid, PROMPTS[rid], GREEDY, priority=5))
    collect(core.step(), tokens)  # the two prompts
    equal = AddRequest("equal", PROMPTS["urgent"], GREEDY, priority=5)
    held = Held()
    held.add([equal])  # as read by the loop mid-step: equal priority never cuts
    collect(core.step(lambda: held), tokens)
    assert (core.num_steps, core.num_steps_cut) == (2, 0)
    urgent = AddRequest("urgent", PROMPTS["urgent"], GREEDY, priority=0)
    held = Held()
    held.add([urgent])
    computed = {rid: core.scheduler.requests[rid].num_computed_tokens for rid in tokens}
    batch = core.step(lambda: held)
    assert batch.outputs == [] and (core.num_steps, core.num_steps_cut) == (2, 1)
    assert {rid: core.scheduler.requests[rid].num_computed_tokens for rid in tokens} == computed
    core.handle(urgent)  # the loop applies what it held, then steps
    ran: list[list[tuple[str, int]]] = []
    execute = core.runner.execute

    def recording(sched, between_layers=None):  # type: ignore[no-untyped-def]
        ran.append([(r.request_id, n) for r, n in sched.scheduled])
        return execute(sched, between_layers)

    core.runner.execute = recording  # type: ignore[method-assign]
    collect(core.step(), tokens)
    assert ran == [[("urgent", len(PROMPTS["urgent"]))]]  # alone: the lows sit it out
    assert len(tokens["urgent"]) == 1
    done: set[str] = set()
    for _ in range(3 * GREEDY.max_tokens + 5):
        done |= collect(core.step(), tokens)
        if len(done) == 3:
            break
    assert ran[1] == [("urgent", 1), ("low0", 1), ("low1", 1)]  # then all decode together
    alone = fcfs.generate(list(PROMPTS.values()), GREEDY)
    assert dict(tokens) == {rid: out.token_ids for rid, out in zip(PROMPTS, alone, strict=True)}
    assert core.scheduler.num_preemptions == 0 and core.kv.num_free_blocks == core.kv.num_blocks


def test_fcfs_never_cuts_a_step_for_an_arrival(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llama, "CHECK_EVERY", 1)
    core = priority_core(tiny_llama_dir, 4, "fcfs")
    core.add_request(AddRequest("low0", PROMPTS["low0"], GREEDY))
    held = Held()
    held.add([AddRequest("urgent", PROMPTS["urgent"], GREEDY, priority=-1)])
    assert core.step(lambda: held).outputs  # ran to the end and sampled
    assert (core.num_steps, core.num_steps_cut) == (1, 0)
