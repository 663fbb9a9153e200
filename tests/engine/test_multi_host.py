"""Tensor parallelism across hosts on torch.distributed (``--nnodes``): node 0 on
127.0.0.2 (the store, rank 0 and the engine), node 1 on 127.0.0.3 (``structllm run
--node-rank 1``: a rank that gets its steps over TCP, not the shared-memory ring).

Greedy tokens equal one process on the exact float32 path; a rank killed mid-run ends
the engine (its connection closes: no collective waits for it), the server reports 503
and restarts the engine, and node 1 joins the new one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from structllm import LLM, SamplingParams
from structllm.engine.runner import ModelRunner
from structllm.protocol import AddRequest
from tests.support.models import EXACT, SPLIT_GREEDY, SPLIT_PROMPTS, assert_same_greedy_as
from tests.support.procs import HANG_S, ROOT, alive, children, python_env, wait_for
from tests.support.server import Server, free_port, open_stream, read_until

pytestmark = pytest.mark.usefixtures("no_shm_leaks")
MASTER, NODE1 = "127.0.0.2", "127.0.0.3"
STREAM = {"prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True}


def node(port: int, *extra: str) -> subprocess.Popen[bytes]:
    """``structllm run --node-rank 1``: waits for node 0's store, then runs rank 1."""
    return subprocess.Popen(
        [
            sys.executable, "-m", "structllm", "run", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", MASTER, "--master-port", str(port), "--node-addr", NODE1, *extra,
        ],
        cwd=ROOT,
        env=python_env(),
    )  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(HANG_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def tiny(tiny_llama_dir: Path) -> str:
    return str(tiny_llama_dir)


def test_tp2_across_two_hosts_matches_one_process(tiny: str) -> None:
    port = free_port(MASTER)
    engine_kw: dict[str, object] = dict(kv_cache_memory=8 << 20, max_num_batched_tokens=48, **EXACT)
    ref = LLM(tiny, **engine_kw)  # type: ignore[arg-type]
    proc = node(port)
    try:
        with LLM(
            tiny,
            tensor_parallel_size=2,
            nnodes=2,
            master_addr=MASTER,
            master_port=port,
            **engine_kw,  # type: ignore[arg-type]
        ) as tp:
            assert tp.engine.workers is not None and tp.engine.workers.pids == []  # no local worker
            assert_same_greedy_as(ref, tp, [*SPLIT_PROMPTS, SPLIT_PROMPTS[1]], logprob_atol=1e-4)
        # the engine closed: node 1's rank exits and the node waits for the next engine
        wait_for(lambda: not children(proc.pid), "node 1's rank outlived the engine")
        assert proc.poll() is None
    finally:
        stop(proc)


@pytest.mark.parametrize("split", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_a_killed_rank_ends_the_engine_and_the_server_restarts_it(tiny: str, split: str) -> None:
    """TP: rank 0 waits in an all-reduce with rank 1; PP: in the receive of the logits
    from rank 1, the last stage. Either way the wait ends when rank 1's connections close."""
    port = free_port(MASTER)
    proc = node(port)
    try:
        with Server(
            tiny, split, "2", "--nnodes", "2", "--master-addr", MASTER,
            "--master-port", str(port), "--kv-cache-memory", "8M", host=MASTER,
        ) as s:  # fmt: skip
            code, _ = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})
            assert code == 200
            (rank1,) = children(proc.pid)
            engine = s.engine_pid
            # a stream in flight on both ranks when rank 1 dies: stopped first, so the
            # engine is inside a step's collective, waiting for it, when it is killed
            stream = open_stream(s.port, "/v1/completions", STREAM, host=MASTER)
            assert b"data: {" in read_until(stream, b"data: {")
            os.kill(rank1, signal.SIGSTOP)
            os.kill(rank1, signal.SIGKILL)
            raw = read_until(stream, b"data: [DONE]", timeout=HANG_S)
            stream.close()
            assert b'"error"' in raw and b'"finish_reason":"length"' not in raw
            wait_for(lambda: not alive(engine), "the engine outlived its rank")
            assert s.get("/health")[0] in (200, 503)
            # the front end restarts the engine; node 1 joins it with a new rank
            wait_for(lambda: s.get("/health")[0] == 200, "the engine was not restarted")
            assert children(proc.pid) and children(proc.pid)[0] != rank1
            code, data = s.post("/v1/completions", {"prompt": "again", "max_tokens": 3})
            assert code == 200, data
    finally:
        stop(proc)


def test_pp2_on_one_host_matches_one_process(tiny: str) -> None:
    engine_kw: dict[str, object] = dict(kv_cache_memory=8 << 20, max_num_batched_tokens=48, **EXACT)
    ref = LLM(tiny, **engine_kw)  # type: ignore[arg-type]
    with LLM(tiny, pipeline_parallel_size=2, **engine_kw) as pp:  # type: ignore[arg-type]
        assert pp.engine.layers is not None and len(pp.engine.runner.kv_caches) == len(  # type: ignore[union-attr]
            pp.engine.layers
        )
        assert_same_greedy_as(ref, pp, [*SPLIT_PROMPTS, SPLIT_PROMPTS[1]], logprob_atol=1e-5)
        assert pp.engine.max_in_flight == 2  # both stages had a batch: the prompts were split
        # the last stage samples (logprobs included) and sends token ids, not logits
        runner = pp.engine.runner
        assert isinstance(runner, ModelRunner) and runner.num_sampled_by_last_stage > 0
        plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        want = [o.token_ids for o in ref.generate(SPLIT_PROMPTS, plain)]
        assert [o.token_ids for o in pp.generate(SPLIT_PROMPTS, plain)] == want
        # seeded random rows too: the same draws as rank 0 would make
        seeded = SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, seed=7, max_tokens=12
        )
        want_seeded = [o.token_ids for o in ref.generate(SPLIT_PROMPTS, seeded)]
        before_seeded = runner.num_sampled_by_last_stage
        assert [o.token_ids for o in pp.generate(SPLIT_PROMPTS, seeded)] == want_seeded
        assert runner.num_sampled_by_last_stage > before_seeded
        # every row is sampled on the last stage: penalties (over the token ids the steps
        # carried), logit bias, min_tokens, logprobs, seeded and unseeded-greedy rows
        rich = [
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2,
                           repetition_penalty=1.8, presence_penalty=1.0, frequency_penalty=0.5),
            SamplingParams(temperature=0.9, seed=3, max_tokens=12, min_tokens=12, logprobs=0,
                           logit_bias={5: 8.0, 9: -100.0}),
            SamplingParams(temperature=0.8, top_k=40, seed=11, max_tokens=12, ignore_eos=True,
                           frequency_penalty=1.5),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={42: 5.0}),
        ]  # fmt: skip
        want_rich = ref.generate(SPLIT_PROMPTS, rich)
        assert want_rich[0].token_ids != want[0] and want_rich[3].token_ids != want[3]  # they act
        before_rich = runner.num_sampled_by_last_stage
        got_rich = pp.generate(SPLIT_PROMPTS, rich)
        assert [o.token_ids for o in got_rich] == [o.token_ids for o in want_rich]
        for g, w in zip(got_rich, want_rich, strict=True):
            assert len(g.logprobs or []) == len(w.logprobs or [])
            for a, b in zip(g.logprobs or [], w.logprobs or [], strict=True):
                assert a.top_ids == b.top_ids
                assert abs(a.logprob - b.logprob) < 1e-5
        assert runner.num_sampled_by_last_stage >= before_rich + 12
        # a step budget too small for the penalised requests' token ids: those steps are
        # sampled on rank 0 from the logits until the last stage has them, same tokens
        budget, runner.stage_feed.budget = runner.stage_feed.budget, 400
        got_rich = pp.generate(SPLIT_PROMPTS, rich)
        runner.stage_feed.budget = budget
        assert runner.stage_feed.num_over_budget > 0
        assert [o.token_ids for o in got_rich] == [o.token_ids for o in want_rich]
        # prompt rows scored (their logits go to rank 0) beside rows sampled on the last stage
        scored = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, logprobs=1)
        (w,), (g,) = (
            ref.generate([SPLIT_PROMPTS[1]], scored),
            pp.generate([SPLIT_PROMPTS[1]], scored),
        )
        assert g.token_ids == w.token_ids and w.prompt_logprobs and g.prompt_logprobs
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            assert a is not None and b is not None and a.top_ids == b.top_ids
            assert abs(a.logprob - b.logprob) < 1e-5
        # an abort while the request's batch is in flight: no token of it after the abort,
        # the others unaffected, every block back
        eng = pp.engine
        for i, prompt in enumerate(SPLIT_PROMPTS):
            eng.add_request(AddRequest(f"r{i}", prompt, plain))
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(SPLIT_PROMPTS))}
        before = eng.step().outputs  # two batches submitted, the first completed
        victim = sorted(eng.requests_in_flight)[0]
        eng.abort([victim])
        after = []
        steps = 0
        while eng.has_work and steps < 1000:  # (bounded: a bug must not hang the test)
            after += eng.step().outputs
            steps += 1
        for d in [*before, *after]:
            got[d.request_id] += d.new_token_ids
        mine = [(d.new_token_ids, d.finish_reason) for d in after if d.request_id == victim]
        assert mine == [([], "abort")]
        partial = got.pop(victim)
        assert partial == want[int(victim[1:])][: len(partial)]
        assert got == {f"r{i}": w for i, w in enumerate(want) if f"r{i}" != victim}
        assert not eng.requests_in_flight and eng.kv.num_free_blocks == eng.kv.num_blocks


def test_pp2_across_two_hosts_matches_one_process(tiny: str) -> None:
    port = free_port(MASTER)
    engine_kw: dict[str, object] = dict(kv_cache_memory=8 << 20, max_num_batched_tokens=48, **EXACT)
    ref = LLM(tiny, **engine_kw)  # type: ignore[arg-type]
    proc = node(port)
    try:
        with LLM(
            tiny,
            pipeline_parallel_size=2,
            nnodes=2,
            master_addr=MASTER,
            master_port=port,
            **engine_kw,  # type: ignore[arg-type]
        ) as pp:
            assert_same_greedy_as(ref, pp, [*SPLIT_PROMPTS, SPLIT_PROMPTS[1]], logprob_atol=1e-5)
    finally:
        stop(proc)


def test_tp2_x_pp2_matches_one_process(tiny: str) -> None:
    """4 ranks: two stages of two tensor-parallel ranks (rank = stage * 2 + TP rank)."""
    engine_kw: dict[str, object] = dict(kv_cache_memory=8 << 20, max_num_batched_tokens=48, **EXACT)
    ref = LLM(tiny, **engine_kw)  # type: ignore[arg-type]
    with LLM(
        tiny,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        **engine_kw,  # type: ignore[arg-type]
    ) as split:
        assert split.engine.workers is not None and len(split.engine.workers.pids) == 3
        assert_same_greedy_as(ref, split, [*SPLIT_PROMPTS, SPLIT_PROMPTS[1]], logprob_atol=1e-4)
        # the last stage's TP rank 0 samples from the gathered logits and sends the ids
        plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        want = [o.token_ids for o in ref.generate(SPLIT_PROMPTS, plain)]
        assert [o.token_ids for o in split.generate(SPLIT_PROMPTS, plain)] == want
        runner = split.engine.runner
        assert isinstance(runner, ModelRunner) and runner.num_sampled_by_last_stage > 0


# -- real isolation: two network namespaces ----------------------------------------------

NODE0 = """
import json, sys
from structllm import LLM
from tests.support.models import EXACT, SPLIT_GREEDY, SPLIT_PROMPTS
tiny, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
with LLM(tiny, tensor_parallel_size=2, nnodes=2, master_addr=addr, master_port=port,
         kv_cache_memory=8 << 20, max_num_batched_tokens=48, **EXACT) as tp:
    outs = tp.generate(SPLIT_PROMPTS, SPLIT_GREEDY)
print(json.dumps([[o.token_ids, [lp.logprob for lp in o.logprobs]] for o in outs]))
"""


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextmanager
def two_namespaced_hosts() -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """Two network namespaces joined by a veth pair, each end with an address in
    10.254.x.0/24: ``((ns0, addr0), (ns1, addr1))``. Neither sees this machine's
    loopback or any other interface. Removed on exit, whatever happened (deleting a
    namespace deletes the veth end in it, and the pair with it)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")
    tag = f"sl{os.getpid() % 100000}"
    net = f"10.254.{os.getpid() % 250}"
    hosts = ((f"{tag}a", f"{net}.1"), (f"{tag}b", f"{net}.2"))
    made: list[str] = []
    try:
        for ns, _ in hosts:
            r = ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"cannot create a network namespace (CAP_NET_ADMIN?): {r.stderr}")
            made.append(ns)
        steps = [("link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y")]
        for (ns, addr), dev in zip(hosts, (f"{tag}x", f"{tag}y"), strict=True):
            steps += [
                ("link", "set", dev, "netns", ns),
                ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                ("-n", ns, "link", "set", dev, "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            r = ip(*step)
            assert r.returncode == 0, f"ip {' '.join(step)}: {r.stderr}"
        yield hosts
    finally:
        for ns in made:
            ip("netns", "del", ns)
        ip("link", "del", f"{tag}x")  # (only if the pair never left this namespace)


def test_tp2_across_two_network_namespaces_matches_one_process(tiny: str) -> None:
    """Node 0 (store, rank 0, engine) and node 1 each in their own network namespace:
    the ranks can reach each other only over the veth pair, so nothing can pass through
    a loopback shortcut. Greedy tokens equal one process."""
    ref = LLM(tiny, kv_cache_memory=8 << 20, max_num_batched_tokens=48, **EXACT)  # type: ignore[arg-type]
    want = ref.generate(SPLIT_PROMPTS, SPLIT_GREEDY)
    with two_namespaced_hosts() as ((ns0, addr0), (ns1, addr1)):
        port = "29500"  # the namespaces are new: nothing else listens in them
        node1 = subprocess.Popen(
            [
                "ip", "netns", "exec", ns1, sys.executable, "-m", "structllm", "run",
                "--nnodes", "2", "--node-rank", "1", "--master-addr", addr0,
                "--master-port", port, "--node-addr", addr1,
            ],
            cwd=ROOT,
            env=python_env(),
        )  # fmt: skip
        try:
            node0 = subprocess.run(
                ["ip", "netns", "exec", ns0, sys.executable, "-c", NODE0, tiny, addr0, port],
                cwd=ROOT,
                env=python_env(),
                capture_output=True,
                text=True,
                timeout=2 * HANG_S,
            )
            assert node0.returncode == 0, node0.stderr[-3000:]
        finally:
            stop(node1)
    got = json.loads(node0.stdout.strip().splitlines()[-1])
    for w, (tokens, logprobs) in zip(want, got, strict=True):
        assert tokens == w.token_ids
        assert max(abs(a.logprob - b) for a, b in zip(w.logprobs, logprobs, strict=True)) < 1e-4
