r"""Past one machine, measured on one: replicas behind ``vllm-router``, and one model split
over two loopback "hosts" (127.0.0.2, 127.0.0.3).

    python bench/scale_out.py                   # all parts
    python bench/scale_out.py --part router     # (a) only
    python bench/scale_out.py --part split      # (b) only
    python bench/scale_out.py --part pipeline   # (c) only
    python bench/scale_out.py --part sampling   # (d) only

(a) **Replicas.** 1, 2 and 3 ``structllm run`` replicas (on 127.0.0.2-4) of a small
random-weight model (exact float32, so prefill work is real: prefix-cache hits save it)
behind the router, ``cache_aware`` against ``round_robin``, on a multi-turn chat
workload: ``--conversations`` conversations of 4 turns, each turn's prompt the whole
conversation so far (a long system prompt of its own, then the turns), ``--concurrency``
conversations at a time. Prints requests/s, mean and p90 time to first token (streamed),
and the prefix-cache hit rate over all replicas (hit tokens / prompt tokens looked up).
Each run uses fresh conversation texts, so no run finds another's prefixes cached.

(b) **One model over two hosts.** The offline engine, decode steps of a batch of
``--batch`` sequences: one process, TP=2 and PP=2 on one host, and TP=2 and PP=2 with
rank 1 on another "host" (``structllm run --node-rank 1``, steps over TCP). Throughput
(generated tokens/s over the batch), the most batches in flight, and per step (with
PP=2 a step is one of the batches in flight, about half the sequences): the wall
time, and rank 0's time in communication (handing the step to the other ranks,
collectives, pipeline sends and receives; a receive also waits for the other rank's
compute). Then what a real network would add per step, from the bytes each step moves
and an assumed link (``--link-gbps``, ``--link-latency-us``): TP sends two all-reduces of
``[batch, hidden]`` per layer (a 2-rank all-reduce moves the tensor once each way) and
gathers the logits' vocabulary halves; PP sends ``[batch, hidden]`` once per stage
boundary and the sampled token ids ``[batch]`` back to rank 0 (the last stage samples).

(c) **Batches in flight through the pipeline.** One process (PP=1), and PP=2 on this
host with one batch in flight (the stages take turns) and with two (vLLM's virtual
engines: each batch about half the requests): generated tokens/s of a batch of
``--batch`` greedy sequences (decode), and prompt tokens/s of ``--batch`` fresh prompts
of ``--prompt-len`` tokens (prefill); the three measured in turn, ``--rounds`` times,
medians.

(d) **Where a pipeline samples.** PP=2 on this host, decode steps of ``--batch``
sequences that ask for top-5 logprobs and a repetition penalty: the last stage samples
them (token ids and logprobs come back) against rank 0 sampling from the logits
``[batch, vocab]`` float32 the last stage sends (what such rows did before the last
stage sampled every row; forced here by a zero budget for the settings a step carries,
``StageFeed.budget``), one engine, alternating, ``--rounds`` times, medians.

On this machine every "host" shares the same cores, so the split runs measure the
communication path's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from structllm import LLM, SamplingParams  # noqa: E402
from structllm.model.files import find_model_files  # noqa: E402
from structllm.paths import cache_root  # noqa: E402
from tests.support.models import EXACT, make_tiny_hf_dir  # noqa: E402
from tests.support.procs import python_env  # noqa: E402
from tests.support.router import Router  # noqa: E402
from tests.support.server import Server, free_port  # noqa: E402

SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)


def bench_model() -> str:
    """The benchmark's random-weight model, built once into the cache (keyed by shape)."""
    key = "-".join(f"{v}" for v in SHAPE.values())
    root = cache_root() / "bench" / f"scale-out-{key}"
    out = root / "tiny-llama"
    if not (out / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        make_tiny_hf_dir(root, find_model_files(None), "llama", **SHAPE)
    return str(out)


# -- (a) replicas behind the router ---------------------------------------------------


def conversation(salt: str, c: int) -> list[dict[str, str]]:
    facts = " ".join(f"{salt}-{c}-fact{i}" for i in range(110))
    return [{"role": "system", "content": f"Conversation {c}. Remember: {facts}"}]


def ttft_chat(router: Router, messages: list[dict[str, str]]) -> tuple[float, str]:
    """(time to the first chunk with generated text, the reply's text) of one streamed
    chat turn (the first chunk, with the role, leaves before the prompt is computed)."""
    import http.client

    body = json.dumps(
        {"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    ).encode()
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first, text = 0.0, []
    for line in resp:
        if line.startswith(b"data: {"):
            for ch in json.loads(line[6:])["choices"]:
                piece = ch["delta"].get("content") or ""
                if piece and not first:
                    first = time.perf_counter() - t0
                text.append(piece)
    conn.close()
    return first, "".join(text)


def run_workload(
    router: Router, servers: list[Server], salt: str, conversations: int, concurrency: int
) -> dict[str, float]:
    todo = list(range(conversations))
    lock = threading.Lock()
    ttfts: list[float] = []

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                c = todo.pop()
            messages = conversation(salt, c)
            for turn in range(4):
                messages.append({"role": "user", "content": f"turn {turn}: go on"})
                t, reply = ttft_chat(router, messages)
                messages.append({"role": "assistant", "content": reply})
                with lock:
                    ttfts.append(t)

    q0 = sum(s.metric("prefix_cache_queries_total") for s in servers)
    h0 = sum(s.metric("prefix_cache_hits_total") for s in servers)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    q = sum(s.metric("prefix_cache_queries_total") for s in servers) - q0
    h = sum(s.metric("prefix_cache_hits_total") for s in servers) - h0
    ttfts.sort()
    return {
        "requests_per_s": len(ttfts) / wall,
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
        "prefix_hit_rate": h / q if q else 0.0,
    }


def part_router(a: argparse.Namespace) -> list[dict[str, Any]]:
    model = bench_model()
    rows = []
    for n in (1, 2, 3):
        with ExitStack() as stack:
            servers = [
                stack.enter_context(
                    Server(
                        model, *EXACT_FLAGS, "--kv-cache-memory", "256M", host=f"127.0.0.{2 + i}"
                    )
                )
                for i in range(n)
            ]
            for policy in ("cache_aware", "round_robin"):
                with Router([s.url for s in servers], policy) as router:
                    ttft_chat(router, [{"role": "user", "content": "warm up"}])
                    r = run_workload(
                        router, servers, f"{policy}{n}", a.conversations, a.concurrency
                    )
                row = {"replicas": n, "policy": policy, **r}
                print(
                    f"replicas={n} {policy:11s} {r['requests_per_s']:6.2f} req/s  "
                    f"TTFT mean {r['ttft_mean_ms']:7.1f} ms  p90 {r['ttft_p90_ms']:7.1f} ms  "
                    f"prefix hits {100 * r['prefix_hit_rate']:5.1f}%",
                    flush=True,
                )
                rows.append(row)
    return rows


EXACT_FLAGS = ("--dtype", "float32", "--quantization", "none")


# -- (b) one model over two hosts -----------------------------------------------------


def step_times(
    llm: LLM, batch: int, steps: int, sp: SamplingParams | None = None
) -> dict[str, float]:
    """Decode-step wall time and rank 0's communication time, per step (greedy rows,
    unless ``sp``)."""
    prompts = [[100 + 7 * i + j for j in range(32)] for i in range(batch)]
    sp = sp or SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm
    eng = llm.engine
    group, workers = eng.group, eng.workers
    comm0 = group.comm_s if group else 0.0
    pub0 = workers.publish_s if workers else 0.0
    s0 = eng.num_steps
    t0 = time.perf_counter()
    llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    n = eng.num_steps - s0
    return {
        "tokens_per_s": batch * steps / wall,
        "step_ms": 1000 * wall / n,
        "publish_ms": 1000 * ((workers.publish_s if workers else 0.0) - pub0) / n,
        "collective_ms": 1000 * ((group.comm_s if group else 0.0) - comm0) / n,
    }


def network_estimate(kind: str, a: argparse.Namespace, cfg: dict[str, int]) -> float:
    """Milliseconds a decode step's messages take on the assumed link."""
    lat, bw = a.link_latency_us * 1e-6, a.link_gbps * 1e9 / 8
    b, h, v, layers = a.batch, cfg["hidden_size"], 49152, cfg["num_hidden_layers"]
    # TP: 2 all-reduces of [b, h] float32 per layer + the embedding's, the logits gather;
    # PP: one boundary's hidden states, the sampled ids back (the last stage samples)
    tp = [(b * h * 4)] * (2 * layers + 1) + [b * v // 2 * 4]
    msgs = tp if kind == "tp" else [b * h * 4, b * 8]
    step = 2000  # the step's description, about 2 KB at this batch
    return 1000 * sum(lat + m / bw for m in [step, *msgs])


def part_split(a: argparse.Namespace) -> list[dict[str, Any]]:
    model = bench_model()
    kw: dict[str, Any] = dict(kv_cache_memory=256 << 20, **EXACT)
    rows = []
    runs: list[tuple[str, dict[str, Any], bool]] = [
        ("one process", {}, False),
        ("TP=2 one host", {"tensor_parallel_size": 2}, False),
        ("PP=2 one host", {"pipeline_parallel_size": 2}, False),
        ("TP=2 two hosts", {"tensor_parallel_size": 2}, True),
        ("PP=2 two hosts", {"pipeline_parallel_size": 2}, True),
    ]
    for name, extra, two_hosts in runs:
        if a.only and not any(o in name for o in a.only):
            continue
        if extra:  # two ranks share this machine's cores, wherever "hosts" they are on
            extra = {**extra, "num_threads": max(1, len(os.sched_getaffinity(0)) // 2)}
        node = None
        if two_hosts:
            port = free_port("127.0.0.2")
            extra = {**extra, "nnodes": 2, "master_addr": "127.0.0.2", "master_port": port}
            node = subprocess.Popen(
                [
                    sys.executable, "-m", "structllm", "run", "--nnodes", "2", "--node-rank",
                    "1", "--master-addr", "127.0.0.2", "--master-port", str(port),
                    "--node-addr", "127.0.0.3",
                ],
                cwd=ROOT, env=python_env(), stderr=subprocess.DEVNULL,
            )  # fmt: skip
        try:
            with LLM(model, **kw, **extra) as llm:
                r = step_times(llm, a.batch, a.steps)
                r["max_in_flight"] = llm.engine.max_in_flight
        finally:
            if node is not None:
                node.terminate()
                node.wait()
        kind = "tp" if "TP" in name else "pp" if "PP" in name else ""
        net = network_estimate(kind, a, SHAPE) if kind else 0.0
        rows.append({"run": name, **r, "network_ms_assumed": net})
        print(
            f"{name:16s} {r['tokens_per_s']:7.1f} tok/s  {r['max_in_flight']} in flight  "
            f"step {r['step_ms']:7.2f} ms  hand-off {r['publish_ms']:6.2f} ms  "
            f"collectives/sends {r['collective_ms']:6.2f} ms  "
            f"+{net:5.2f} ms on a {a.link_gbps:g} Gb/s, {a.link_latency_us:g} us link",
            flush=True,
        )
    return rows


_salt = iter(range(1, 1 << 30))


def prefill_rate(llm: LLM, prompts: int, length: int) -> float:
    """Prompt tokens/s over ``prompts`` fresh prompts of ``length`` tokens, one token
    generated each (prompts never seen before, so the prefix cache saves nothing)."""
    salt = next(_salt)
    batch = [
        [(salt * 7919 + 104729 * i + j) % 40000 + 100 for j in range(length)]
        for i in range(prompts)
    ]
    t0 = time.perf_counter()
    llm.generate(batch, SamplingParams(temperature=0, max_tokens=1))
    return prompts * length / (time.perf_counter() - t0)


def part_pipeline(a: argparse.Namespace) -> list[dict[str, Any]]:
    """(c) Throughput of PP=1 (one process) against PP=2 on this host with one batch in
    flight (stages take turns) and with two (``EngineCore.pipeline_depth``), all three
    engines loaded at once and measured in turn, ``--rounds`` times, so a change in the
    machine's load hits all three alike. Medians."""
    model = bench_model()
    kw: dict[str, Any] = dict(kv_cache_memory=256 << 20, **EXACT)
    half = max(1, len(os.sched_getaffinity(0)) // 2)
    names = ("PP=1", "PP=2, 1 in flight", "PP=2, 2 in flight")
    decode: dict[str, list[float]] = {n: [] for n in names}
    prefill: dict[str, list[float]] = {n: [] for n in names}
    with (
        LLM(model, **kw) as one,
        LLM(model, pipeline_parallel_size=2, num_threads=half, **kw) as pp,
    ):
        for _ in range(a.rounds):
            for name in names:
                llm = one if name == "PP=1" else pp
                if llm is pp:
                    pp.engine.pipeline_depth = 1 if "1 in flight" in name else 2
                decode[name].append(step_times(llm, a.batch, a.steps)["tokens_per_s"])
                prefill[name].append(prefill_rate(llm, a.batch, a.prompt_len))
        assert pp.engine.max_in_flight == 2
    rows = []
    for kind, results in (("decode", decode), ("prefill", prefill)):
        base = statistics.median(results["PP=1"])
        for name, tps in results.items():
            med = statistics.median(tps)
            rows.append({"run": name, "kind": kind, "tokens_per_s": med, "all": tps})
            runs = " ".join(f"{t:.1f}" for t in tps)
            print(
                f"{kind:7s} {name:18s} {med:8.1f} tok/s (x{med / base:.2f} of PP=1; runs {runs})",
                flush=True,
            )
    return rows


def part_sampling(a: argparse.Namespace) -> list[dict[str, Any]]:
    """(d) The last stage sampling rows with logprobs and a penalty, against rank 0
    sampling them from the logits, on one PP=2 engine, alternating. Medians."""
    from structllm.engine.runner import ModelRunner

    model = bench_model()
    kw: dict[str, Any] = dict(kv_cache_memory=256 << 20, **EXACT)
    half = max(1, len(os.sched_getaffinity(0)) // 2)
    sp = SamplingParams(
        temperature=0, max_tokens=a.steps, ignore_eos=True, logprobs=5, repetition_penalty=1.1
    )
    arms = ("last stage samples", "rank 0 samples")
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in arms}
    with LLM(model, pipeline_parallel_size=2, num_threads=half, **kw) as pp:
        runner = pp.engine.runner
        assert isinstance(runner, ModelRunner)
        budget = runner.stage_feed.budget
        for _ in range(a.rounds):
            for name in arms:
                runner.stage_feed.budget = budget if name == arms[0] else 0
                before = runner.stage_feed.num_over_budget
                runs[name].append(step_times(pp, a.batch, a.steps, sp))
                assert (runner.stage_feed.num_over_budget > before) == (name == arms[1])
    rows = []
    for name, results in runs.items():
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        rows.append({"run": name, **med, "all": results})
        steps = " ".join(f"{r['step_ms']:.2f}" for r in results)
        print(
            f"{name:20s} {med['tokens_per_s']:7.1f} tok/s  step {med['step_ms']:7.2f} ms  "
            f"sends/receives {med['collective_ms']:6.2f} ms  (steps: {steps} ms)",
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--part", choices=["router", "split", "pipeline", "sampling", "all"], default="all"
    )
    p.add_argument("--rounds", type=int, default=3, help="(c): measurements of each")
    p.add_argument("--prompt-len", type=int, default=256, help="(c): prefill prompts' length")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument(
        "--only", nargs="*", default=[], help="(b): only the runs whose name contains one"
    )
    p.add_argument("--link-gbps", type=float, default=10.0)
    p.add_argument("--link-latency-us", type=float, default=50.0)
    a = p.parse_args()
    # SIGTERM unwinds like an exception, so the replicas and routers started are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if "model name" in ln), "?")
    cpu += ", AVX-512" if any("avx512f" in ln for ln in info if ln.startswith("flags")) else ""
    print(f"# {cpu}; model {SHAPE}", flush=True)
    out: dict[str, Any] = {}
    if a.part in ("split", "all"):
        out["split"] = part_split(a)
    if a.part in ("pipeline", "all"):
        out["pipeline"] = part_pipeline(a)
    if a.part in ("sampling", "all"):
        out["sampling"] = part_sampling(a)
    if a.part in ("router", "all"):
        out["router"] = part_router(a)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
