"""The priority scheduling policy through the engine (tiny exact float32 Llama): an
urgent request takes a full batch's seat within one step, the request it preempted
resumes and loses nothing, and the offline API takes vLLM's ``priority`` argument."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from structllm import LLM
from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
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
