"""The persistent decode batch (``engine/decode_batch.py``): a plain decode step laid
out in place is the batch ``ModelRunner.prepare``'s general path builds, field for
field and tensor for tensor, as the rows' block tables grow and rows come and go; its
tensors are the same objects from step to step while the shape holds; steps it does
not take (prompt chunks) still go the general way; greedy tokens are unchanged; decode
steps with LoRA adapter rows take it too, naming the same adapters and rows."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import torch

from structllm.config import EngineConfig, SpeculativeConfig
from structllm.engine.core import EngineCore
from structllm.engine.runner import Batch, ModelRunner
from structllm.engine.scheduler import SchedulerOutput
from structllm.protocol import AddRequest, LoraRef, SamplingParams
from tests.support.adapters import peft_adapter
from tests.support.models import tiny_family_dir


def engine(**kw: Any) -> EngineCore:
    return EngineCore(
        EngineConfig(
            kv_cache_memory=32 << 20,
            max_num_seqs=4,
            speculative_config=SpeculativeConfig(method="none"),
            **kw,
        )
    )


def add(
    core: EngineCore, rid: str, prompt_len: int, max_tokens: int, lora: LoraRef | None = None
) -> None:
    ids = [100 + (7 * i + len(rid)) % 3000 for i in range(prompt_len)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(AddRequest(rid, ids, sp, lora=lora))


def same(a: Batch, b: Batch) -> None:
    """Two batches of one step hold the same inputs."""
    enc = msgspec.msgpack.Encoder()
    assert enc.encode(a.step) == enc.encode(b.step)
    for x, y in (
        (a.input_ids, b.input_ids),
        (a.positions, b.positions),
        (a.meta.slot_mapping, b.meta.slot_mapping),
        (a.meta.block_tables, b.meta.block_tables),
        (a.meta.seq_lens, b.meta.seq_lens),
        (a.meta.query_start_loc, b.meta.query_start_loc),
    ):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert a.meta.seq_lens_list == b.meta.seq_lens_list
    assert a.meta.query_start_list == b.meta.query_start_list
    assert (a.meta.num_decodes, a.meta.max_seq_len) == (b.meta.num_decodes, b.meta.max_seq_len)
    assert a.sample_reqs == b.sample_reqs and a.sample_counts == b.sample_counts
    assert not a.prompt_spans and not b.prompt_spans
    assert (a.lora is None) == (b.lora is None)
    if a.lora is not None and b.lora is not None:  # the same adapters over the same rows
        assert torch.equal(a.lora.rows, b.lora.rows) and a.lora.starts == b.lora.starts
        assert [g.uid for g, _ in a.lora.groups] == [g.uid for g, _ in b.lora.groups]


def checked(core: EngineCore) -> list[tuple[Batch, bool]]:
    """Every step of ``core`` laid out by ``prepare`` and checked against the general
    path's layout; the batches, each with whether its rows were all plain decodes."""
    runner = core.runner
    assert isinstance(runner, ModelRunner) and runner.decode_batch is not None
    prepare = runner.prepare
    fast = runner.decode_batch
    seen: list[tuple[Batch, bool]] = []

    def both(sched: SchedulerOutput) -> Batch:
        """The step as laid out, and checked against the general path's layout."""
        batch = prepare(sched)
        runner.decode_batch = None
        try:
            general = prepare(sched)
        finally:
            runner.decode_batch = fast
        same(batch, general)
        plain = all(n == 1 for _, n in sched.scheduled)
        seen.append((batch, plain))
        return batch

    runner.prepare = both  # type: ignore[method-assign]
    return seen


def test_in_place_layout_is_the_general_one() -> None:
    core = engine()
    seen = checked(core)
    # prompts of 1-3 blocks; their tables grow at different steps, and one request ends
    # early, so the step's rows and table width change while others decode on
    add(core, "a", 5, 40)
    add(core, "b", 20, 12)
    add(core, "c", 40, 40)
    for _ in range(200):
        if not core.has_work:
            break
        core.step()
    assert not core.has_work
    decodes = [b for b, plain in seen if plain]
    assert len(decodes) >= 30
    # the in-place path ran: consecutive steps of one shape share their tensors
    shared = sum(
        x.input_ids is y.input_ids and x.meta.block_tables is y.meta.block_tables
        for x, y in itertools.pairwise(decodes)
    )
    assert shared >= len(decodes) // 2
    # a prompt chunk's step is the general path's own (fresh tensors)
    assert any(not plain for _, plain in seen)


def tokens(core: EngineCore) -> dict[str, list[int]]:
    add(core, "x", 9, 24)
    add(core, "y", 33, 24)
    out: dict[str, list[int]] = {"x": [], "y": []}
    while core.has_work:
        for d in core.step().outputs:
            out[d.request_id] += d.new_token_ids
    return out


def test_greedy_tokens_unchanged() -> None:
    core = engine()
    runner: Any = core.runner
    with_batch = tokens(core)
    runner.decode_batch = None
    without = tokens(core)
    assert with_batch == without
    assert all(len(v) == 24 for v in with_batch.values())


def test_decode_steps_with_adapters_are_laid_out_in_place(default_files: Any) -> None:
    # requests [a, base, b, a] decoding together: the in-place step names the same
    # adapters (the wire form's loras / lora_spans) and the same rows as the general
    # path, and the greedy tokens are those of the general path
    base = tiny_family_dir("llama", default_files)
    a = LoraRef("a", 1, str(peft_adapter(base, 1)))
    b = LoraRef("b", 2, str(peft_adapter(base, 2)))
    runs = []
    for fast in (True, False):
        core = engine(model=str(base), enable_lora=True, max_loras=2)
        if fast:
            seen = checked(core)
        else:
            core.runner.decode_batch = None  # type: ignore[union-attr]
        for rid, lora in (("a1", a), ("n", None), ("b", b), ("a2", a)):
            add(core, rid, 6 + len(rid), 10, lora)
        out: dict[str, list[int]] = {}
        while core.has_work:
            for d in core.step().outputs:
                out.setdefault(d.request_id, []).extend(d.new_token_ids)
        runs.append(out)
        if fast:
            with_adapters = [bt for bt, plain in seen if plain and bt.lora is not None]
            assert len(with_adapters) >= 5  # decode steps with adapter rows, laid in place
            assert any(x.input_ids is y.input_ids for x, y in itertools.pairwise(with_adapters))
            assert all(len(bt.step.loras) == 2 for bt in with_adapters)
        core.close()
    assert runs[0] == runs[1] and all(len(v) == 10 for v in runs[0].values())
