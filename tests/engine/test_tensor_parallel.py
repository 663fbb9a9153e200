"""Tensor parallelism on CPU (gloo, 2 processes): the shard plan, outputs identical to the
single-process engine on tiny random models and on the default model, and the death of
a worker handled like an engine death (offline and in the server's engine process).

Greedy tokens are compared exactly, and logits with a tolerance: the all-reduce sums
partial products in another order, so float32 results differ in the last bits. Each
comparison also checks the premise that makes exact tokens meaningful: the reference's
top-2 gap at every generated step is far larger than that difference.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import msgspec
import pytest
import torch

from structllm import LLM, SamplingParams
from structllm.cli import _engine_kwargs, build_parser
from structllm.client import EngineClient, EngineDeadError
from structllm.config import EngineConfig
from structllm.engine import worker_pool
from structllm.engine.core import EngineCore
from structllm.engine.worker_pool import WorkerDied
from structllm.launch import open_engine
from structllm.model.config import ModelConfig
from structllm.model.sharding import plan_shards, shard_weights
from tests.support.models import EXACT, make_tiny_hf_dir, prefill_logits
from tests.support.procs import HANG_S, alive, children, python_env

pytestmark = pytest.mark.usefixtures("no_shm_leaks")

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 180)), [7], list(range(500, 900, 7))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def wait_gone(pids: list[int], timeout: float = HANG_S) -> None:
    """Until ``pids`` are gone (``timeout`` guards against a hang; their exits are
    events: parent-death signal, pipe EOF, failed collectives)."""
    end = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.02)
    assert not any(alive(p) for p in pids), f"processes {pids} outlived their engine"


# -- the plan -------------------------------------------------------------------------


def cfg(heads: int, kv: int, ffn: int = 128, vocab: int = 1000) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=ffn, num_layers=1,
        num_heads=heads, num_kv_heads=kv, head_dim=8,
    )  # fmt: skip


def test_kv_groups_are_split_whole_and_unevenly_when_n_does_not_divide_them() -> None:
    """SmolLM2-135M's shape: 9 query heads in 3 KV groups over 2 ranks."""
    p0, p1 = plan_shards(cfg(9, 3, ffn=1536, vocab=49153), 2)
    assert (p0.kv_heads, p0.heads) == (range(0, 1), range(0, 3))
    assert (p1.kv_heads, p1.heads) == (range(1, 3), range(3, 9))
    assert (p0.ffn, p1.ffn) == (range(0, 768), range(768, 1536))
    assert (p0.vocab, p1.vocab) == (range(0, 24576), range(24576, 49153))
    assert p0.vocab_sizes == (24576, 24577) and p0.vocab_stride == 24577


def test_fewer_kv_heads_than_ranks_are_replicated() -> None:
    plans = plan_shards(cfg(8, 2), 4)
    assert [p.kv_heads for p in plans] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [p.heads for p in plans] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


@pytest.mark.parametrize(
    ("heads", "kv", "n", "message"),
    [
        (4, 2, 5, "tensor_parallel_size 5 exceeds the model's 4 attention heads"),
        (9, 3, 4, "the model's 3 KV heads cannot be split over tensor_parallel_size 4"),
        (6, 2, 4, "would split each KV head's 3 query heads over 2 ranks"),
    ],
)
def test_unsplittable_models_are_refused_naming_the_numbers(
    heads: int, kv: int, n: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan_shards(cfg(heads, kv), n)


@pytest.mark.parametrize(("heads", "kv", "n"), [(9, 3, 2), (8, 2, 4), (4, 4, 3)])
def test_shards_put_back_together_give_the_full_weights(heads: int, kv: int, n: int) -> None:
    c = cfg(heads, kv, ffn=101, vocab=1001)
    d, h, f = c.head_dim, c.hidden_size, c.intermediate_size
    qkv_rows = (heads + 2 * kv) * d
    full = {
        "layers.0.qkv_proj": torch.randn(qkv_rows, h),
        "layers.0.qkv_bias": torch.randn(qkv_rows),
        "layers.0.o_proj": torch.randn(h, heads * d),
        "layers.0.gate_up_proj": torch.randn(2 * f, h),
        "layers.0.down_proj": torch.randn(h, f),
        "layers.0.input_layernorm": torch.randn(h),
        "embed_tokens": torch.randn(c.vocab_size, h),
    }
    plans = plan_shards(c, n)
    shards = [shard_weights(full, c, p) for p in plans]
    q_full, k_full, v_full = full["layers.0.qkv_proj"].split([heads * d, kv * d, kv * d])
    q, k, v = [], {}, {}
    for p, s in zip(plans, shards, strict=True):
        for name in ("layers.0.qkv_proj", "layers.0.qkv_bias"):
            assert s[name].shape[0] == (p.num_heads + 2 * p.num_kv_heads) * d
        sq, sk, sv = s["layers.0.qkv_proj"].split(
            [p.num_heads * d, p.num_kv_heads * d, p.num_kv_heads * d]
        )
        q.append(sq)
        for j, head in enumerate(p.kv_heads):  # a replicated KV head must be the same copy
            k.setdefault(head, sk[j * d : (j + 1) * d])
            v.setdefault(head, sv[j * d : (j + 1) * d])
            assert torch.equal(k[head], sk[j * d : (j + 1) * d]) and torch.equal(
                v[head], sv[j * d : (j + 1) * d]
            )
        assert (
            s["layers.0.input_layernorm"].data_ptr() != full["layers.0.input_layernorm"].data_ptr()
        )
    assert torch.equal(torch.cat(q), q_full)
    assert torch.equal(torch.cat([k[i] for i in range(kv)]), k_full)
    assert torch.equal(torch.cat([v[i] for i in range(kv)]), v_full)
    assert torch.equal(
        torch.cat([s["layers.0.o_proj"] for s in shards], dim=1), full["layers.0.o_proj"]
    )
    assert torch.equal(
        torch.cat([s["layers.0.down_proj"] for s in shards], dim=1), full["layers.0.down_proj"]
    )
    gates, ups = zip(*(s["layers.0.gate_up_proj"].chunk(2) for s in shards), strict=True)
    assert torch.equal(torch.cat([*gates, *ups]), full["layers.0.gate_up_proj"])
    assert torch.equal(torch.cat([s["embed_tokens"] for s in shards]), full["embed_tokens"])


def test_config_and_cli() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(tensor_parallel_size=0)
    args = build_parser().parse_args(["run", "--tensor-parallel-size", "2"])
    assert _engine_kwargs(args)["tensor_parallel_size"] == 2
    assert (
        _engine_kwargs(build_parser().parse_args(["generate", "-p", "x", "-tp", "3"]))[
            "tensor_parallel_size"
        ]
        == 3
    )


def test_an_unsplittable_model_fails_before_any_worker_starts(tiny_llama_dir: Path) -> None:
    before = children(os.getpid())
    with pytest.raises(
        ValueError, match="the model's 2 KV heads cannot be split over tensor_parallel_size 3"
    ):
        EngineCore(
            EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, tensor_parallel_size=3)
        )
    assert children(os.getpid()) == before


# -- identical outputs ------------------------------------------------------------------


def assert_same_greedy(ref: LLM, tp: LLM, prompts: list[object], logprob_atol: float) -> None:
    want = ref.generate(prompts, GREEDY)  # type: ignore[arg-type]
    got = tp.generate(prompts, GREEDY)  # type: ignore[arg-type]
    for w, g in zip(want, got, strict=True):
        assert w.logprobs is not None and g.logprobs is not None
        gaps = [
            lp.top_logprobs[0] - lp.top_logprobs[1] for lp in w.logprobs if len(lp.top_logprobs) > 1
        ]
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(w.logprobs, g.logprobs, strict=False))
        assert diff < logprob_atol
        assert not gaps or min(gaps) > 10 * logprob_atol, "a near-tie: choose another prompt"
        assert g.token_ids == w.token_ids


TINY_SHAPES: dict[str, tuple[int, dict[str, object]]] = {
    # 4 query heads over 2 KV heads: one group per rank.
    "gqa": (2, {}),
    # Qwen2 (qkv bias), 3 KV groups on 2 ranks, odd MLP width and vocabulary, tied head.
    "uneven": (2, dict(arch="qwen2", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                       intermediate_size=101, vocab_size=49153, tie_word_embeddings=True)),
    # one KV head replicated on both ranks
    "replicated": (2, dict(num_attention_heads=4, num_key_value_heads=1)),
    # 4 ranks (3 readers of the broadcast ring), each KV head on two of them
    "4-ranks": (4, dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=130)),
}  # fmt: skip


@pytest.mark.parametrize("shape", list(TINY_SHAPES))
def test_tiny_model_tp_matches_one_process(tmp_path: Path, default_files, shape: str) -> None:  # type: ignore[no-untyped-def]
    world, overrides = TINY_SHAPES[shape]
    kw = dict(overrides)
    arch = str(kw.pop("arch", "llama"))
    path = str(make_tiny_hf_dir(tmp_path, default_files, arch, **kw))
    engine_kw = dict(
        kv_cache_memory=8 << 20, max_num_batched_tokens=48
    )  # chunked prefill, mixed steps
    ref = LLM(path, **engine_kw)
    with LLM(path, tensor_parallel_size=world, **engine_kw) as tp:
        # The budget is per rank, and the rank with the most KV heads sets the block count
        # (in the KV cache's dtype: float16 where auto runs the weights as float16).
        mcfg = tp.engine.files.config
        heads = max(p.num_kv_heads for p in plan_shards(mcfg, world))
        itemsize = tp.engine.kv_dtype.itemsize
        assert tp.engine.num_blocks == (8 << 20) // (
            2 * mcfg.num_layers * heads * mcfg.head_dim * 16 * itemsize
        )
        # Prompts attend to the float16 cache as decode steps do (the CPU attention kernel
        # reads prefill rows from the cache too): a last-bit difference in K/V from the
        # ranks' sums in another order can flip a float16 rounding, hence decode's bound.
        for ids in PROMPTS[1:3]:
            torch.testing.assert_close(
                prefill_logits(tp.engine, ids),
                prefill_logits(ref.engine, ids),
                atol=1e-4,
                rtol=1e-4,
            )
        assert_same_greedy(
            ref, tp, PROMPTS + [PROMPTS[1]], logprob_atol=1e-4
        )  # the repeat hits the prefix cache


@pytest.mark.slow
def test_default_model_tp2_matches_one_process(llm: LLM) -> None:
    """SmolLM2-135M: 9 query heads in 3 KV groups, split 1 + 2 over the ranks."""
    with LLM(kv_cache_memory=64 << 20, tensor_parallel_size=2, **EXACT) as tp:
        text = "The quick brown fox jumps over the lazy dog. " * 6
        ids = llm.tokenizer.encode(text)
        ref_logits, tp_logits = prefill_logits(llm.engine, ids), prefill_logits(tp.engine, ids)
        torch.testing.assert_close(tp_logits, ref_logits, atol=1e-3, rtol=1e-4)
        prompts: list[object] = [
            "The capital of France is",
            [{"role": "user", "content": "Name three colors."}],
            "def fibonacci(n):",
        ]
        assert_same_greedy(llm, tp, prompts, logprob_atol=1e-3)


# -- worker death and clean-up ----------------------------------------------------------


def test_offline_kill_9_of_a_worker_fails_generate_then_close_reaps(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), kv_cache_memory=8 << 20, tensor_parallel_size=2)
    try:
        assert llm.engine.workers is not None
        (pid,) = llm.engine.workers.pids
        assert llm.generate([1, 2, 3], GREEDY)[0].token_ids
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(
            WorkerDied, match=rf"worker 1 \(pid {pid}\) was killed by signal SIGKILL"
        ):
            llm.generate([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    finally:
        llm.close()
    assert children(os.getpid()) == []


def test_a_step_interrupted_between_collectives_stops_the_workers(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C on rank 0 after the first all-reduce of a step: the worker waits in the
    second, which rank 0 will never join. Closing must not wait for it, and the engine
    must refuse further steps instead of pairing the next step's collectives with it."""
    llm = LLM(str(tiny_llama_dir), kv_cache_memory=8 << 20, tensor_parallel_size=2)
    try:
        group = llm.engine.model.tp if llm.engine.model is not None else None
        assert group is not None and llm.engine.workers is not None
        (pid,) = llm.engine.workers.pids
        real = group.all_reduce
        calls = 0

        def interrupted(t: torch.Tensor) -> None:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise KeyboardInterrupt
            real(t)

        monkeypatch.setattr(group, "all_reduce", interrupted)
        # a grace period no loaded machine comes near: closing must not wait it out
        monkeypatch.setattr(worker_pool, "SHUTDOWN_GRACE_S", 2 * HANG_S)
        t = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            llm.generate([1, 2, 3], GREEDY)
        wait_gone([pid])
        assert time.monotonic() - t < 2 * HANG_S, "closing waited out the shutdown grace period"
        with pytest.raises(WorkerDied, match="stopped after a failed step"):
            llm.generate([1, 2, 3], GREEDY)
    finally:
        llm.close()


def test_a_start_failure_after_the_workers_started_stops_them(tiny_llama_dir: Path) -> None:
    """max_model_len is checked once the ranks agree on the KV cache size."""
    with pytest.raises(
        ValueError, match="max_model_len 100000 exceeds the model's context length 512"
    ):
        LLM(
            str(tiny_llama_dir),
            kv_cache_memory=8 << 20,
            tensor_parallel_size=2,
            max_model_len=100_000,
        )
    assert children(os.getpid()) == []


def test_unclosed_llm_stops_its_workers_when_collected(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), kv_cache_memory=8 << 20, tensor_parallel_size=2)
    assert llm.engine.workers is not None
    pids = llm.engine.workers.pids
    del llm
    gc.collect()
    wait_gone(pids)


EXITING = textwrap.dedent(
    """
    import sys
    from structllm import LLM
    llm = LLM(sys.argv[1], kv_cache_memory=8 << 20, tensor_parallel_size=2)
    print(*llm.engine.workers.pids, flush=True)
    # exits without closing: the pool's finalizer runs at interpreter exit
    """
)


def run_script(script: str, *args: str) -> tuple[list[int], int]:
    """Run ``script``; returns the pids it prints on its first line and its exit code.
    Waits for the process only, not for EOF on its output (workers share that pipe)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, env=python_env()
    )
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        return pids, proc.wait(60)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_workers_stop_at_interpreter_exit(tiny_llama_dir: Path) -> None:
    pids, code = run_script(EXITING, str(tiny_llama_dir))
    assert code == 0 and pids
    wait_gone(pids)


FROM_A_THREAD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from structllm import LLM, SamplingParams
    box = {}
    t = threading.Thread(
        target=lambda: box.update(
            llm=LLM(sys.argv[1], kv_cache_memory=8 << 20, tensor_parallel_size=2)
        )
    )
    t.start()
    t.join()
    # the thread that spawned the workers is gone: no parent-death signal may fire for it
    time.sleep(0.3)
    llm = box["llm"]
    assert llm.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids
    print(*llm.engine.workers.pids, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no finalizer runs: the pipe's EOF must do
    """
)


def test_workers_spawned_from_a_thread_outlive_it_but_not_the_process(tiny_llama_dir: Path) -> None:
    pids, code = run_script(FROM_A_THREAD, str(tiny_llama_dir))
    assert code == -signal.SIGKILL and pids
    wait_gone(pids, 0.5)  # at once: not at its next idle check (1 s later)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_kill_9_of_the_engine_process_takes_its_workers_down(tiny_llama_dir: Path) -> None:
    cfg = EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, tensor_parallel_size=2)
    async with open_engine(cfg) as eng:
        (worker,) = children(eng.pid)
        os.kill(eng.pid, signal.SIGKILL)
        wait_gone([worker])


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("when", ["streaming", "idle"])
async def test_kill_9_of_a_worker_ends_the_engine_process(tiny_llama_dir: Path, when: str) -> None:
    """The server's engine process: a worker's death ends it like an engine death, while
    it streams (a collective fails) or while it sleeps (it watches the workers' pidfds)."""
    cfg = EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, tensor_parallel_size=2)
    async with open_engine(cfg) as eng:
        (worker,) = children(eng.pid)
        client = EngineClient(eng)
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)
            long = SamplingParams(max_tokens=100_000, ignore_eos=True)
            if when == "streaming":
                async with client.request("long", [1, 2, 3], long) as stream:
                    await stream.get()
                    os.kill(worker, signal.SIGKILL)
                    with anyio.fail_after(HANG_S), pytest.raises(EngineDeadError, match="worker 1"):
                        while True:
                            await stream.get()
            else:
                os.kill(worker, signal.SIGKILL)
                with anyio.fail_after(HANG_S):
                    while client.dead is None:  # the client's supervisor saw the engine exit
                        await anyio.sleep(0.02)
                assert "worker 1" in str(client.dead)
            with pytest.raises(EngineDeadError):
                async with client.request("after", [1], long):
                    pass
            tg.cancel_scope.cancel()
    assert eng.process.returncode == 1
    wait_gone([worker, eng.pid])


def test_experts_and_whole_projection_norms_are_cut_per_rank() -> None:
    # every expert keeps its slice of its own intermediate width (not the dense MLP's),
    # the router is whole on every rank; q/k norms over the whole projection keep their
    # heads' entries (the layer all-reduces their sums of squares)
    c = msgspec.structs.replace(
        cfg(4, 2, ffn=128),
        num_experts=3,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        qk_norm="full",
    )
    d, h = c.head_dim, c.hidden_size
    full = {
        "layers.0.moe.router": torch.randn(3, h),
        "layers.0.moe.experts.2.gate_up_proj": torch.randn(2 * 48, h),
        "layers.0.moe.experts.2.down_proj": torch.randn(h, 48),
        "layers.0.q_norm": torch.randn(4 * d),
        "layers.0.k_norm": torch.randn(2 * d),
    }
    plans = plan_shards(c, 2)
    assert [p.expert_ffn for p in plans] == [range(0, 24), range(24, 48)]
    shards = [shard_weights(full, c, p) for p in plans]
    gate, up = full["layers.0.moe.experts.2.gate_up_proj"].chunk(2)
    for p, s in zip(plans, shards, strict=True):
        cols = slice(p.expert_ffn.start, p.expert_ffn.stop)
        assert torch.equal(
            s["layers.0.moe.experts.2.gate_up_proj"], torch.cat([gate[cols], up[cols]])
        )
        assert torch.equal(
            s["layers.0.moe.experts.2.down_proj"], full["layers.0.moe.experts.2.down_proj"][:, cols]
        )
        assert torch.equal(s["layers.0.moe.router"], full["layers.0.moe.router"])
    for name in ("layers.0.q_norm", "layers.0.k_norm"):
        assert torch.equal(torch.cat([s[name] for s in shards]), full[name])
