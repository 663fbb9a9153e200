r"""Where a decode step's time goes, in the engine and through the server.

    python bench/step_breakdown.py [FILE.gguf ...] [--steps 128] [--rows 1] [--serve]
        [--llama-server PATH]

For each GGUF file (default: the default model), in this process: ``--rows`` requests
(default one; each a 64-token prompt, greedy, EOS ignored) decode ``--steps`` tokens
together through ``EngineCore`` (``--rows 16``: the concurrency-16 decode step),
first plain (the step's wall time), then with every component timed
(``perf_counter_ns`` around it, exclusive of the components timed inside it):

- ``matmul``: the layers' weight matmuls (``packed.linear``, the row kernels);
- ``lm_head``: ``compute_logits`` (the head's matmul and what follows it);
- ``attention``: the paged decode attention (``CpuAttention.decode_rows``);
- ``layer_ops``: the fused norms, rotary + KV store, SiLU * up (``cpu_layer.cpp``);
- ``forward_glue``: the rest of the model's forward pass (Python, embedding, views);
- ``sampler``, ``prepare`` (the flat batch), ``schedule`` and ``update`` (the
  scheduler and KV block bookkeeping), ``step_other`` (the rest of ``EngineCore.step``).

``by_matrix``: the block kernels' calls of the decode steps split by block type, kernel
path (int8 / int16 / float, see ``packed.block_mode``) and shape ``N x K``: microseconds
per call and per step, and nanoseconds per weight row and block of 32 (what the type
costs at this many rows, comparable across types and shapes).

``kernels_alone`` is the same matmuls back to back (each weight once, ``--rows`` rows), the floor
the step's matmul time is compared with; everything above it in the step is overhead.
It is also split by block type and path (``Q5_0 int8``, ``head Q8_0 int16``: each matmul
timed alone, a fused matrix's parts each), to compare types and ISAs per weight.
The timers cost a little themselves (measured per call and printed: most of it lands in
``forward_glue``). ``--cpu-clock --threads 1``: every part in thread CPU time, which a
loaded machine inflates far less than wall time.

``--serve`` also starts ``structllm run`` on the file with ``--trace``, streams one
request of ``--steps`` tokens and compares the client's inter-token latency (ITL) with
the engine's own step spans from the trace: ITL - step = ring I/O, the engine loop and
the front end; and the CPU time each process spent per token (all its threads: the
engine's kernel pool and the front end on the same cores). ``--llama-server PATH`` does
the same against llama-server on the file, whose own per-token compute is its reply's
``timings.predicted_per_token_ms``; ``--base-tree DIR`` adds structllm served from another
source tree (a baseline commit). The servers stream in turn, A/B/A/B (``--reps``); the
load average is printed.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve.py, beside this file

PROMPT_LEN = 64


class Timers:
    """Exclusive time per label: a timed call inside another is taken off its parent.
    ``clock``: wall time (``perf_counter_ns``) or this thread's CPU time
    (``thread_time_ns``: with ``--threads 1`` the step's whole cost, whatever the load)."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.clock = clock
        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[list[Any]] = []  # [label, child ns]

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            own = label
            if label == "matmul" and self.stack and self.stack[-1][0] == "lm_head":
                own = "lm_head"
            frame = [own, 0]
            self.stack.append(frame)
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = self.clock() - t0
                self.stack.pop()
                self.ns[own] += dt - frame[1]
                self.calls[own] += own == label  # (not the head's own matmul again)
                if self.stack:
                    self.stack[-1][1] += dt

        return timed

    def reset(self) -> None:
        self.ns.clear()
        self.calls.clear()


class OpsProxy:
    """The fused layer ops (a pybind module) with each function timed."""

    def __init__(self, ops: Any, timers: Timers) -> None:
        self._ops, self._timers = ops, timers

    def __getattr__(self, name: str) -> Any:
        return self._timers.wrap("layer_ops", getattr(self._ops, name))


def add_request(core: Any, rid: str, steps: int, seed: int) -> None:
    import random

    from structllm.protocol import AddRequest, SamplingParams

    rng = random.Random(seed)
    ids = [rng.randrange(100, core.vocab_size - 100) for _ in range(PROMPT_LEN)]
    sp = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    core.add_request(AddRequest(rid, ids, sp))


def prefill(core: Any) -> None:
    """Step until every request has its prompt computed (not timed)."""
    sched = core.scheduler
    while sched.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in sched.running):
        core.step()


class ByMatrix:
    """The block kernels' ``linear`` with each call's thread-or-wall time added up by
    (block type, path, N, K, rows); stands in for ``packed._KERNELS``."""

    PATHS = ("float", "int8", "int16")

    def __init__(self, kernels: Any, clock: Callable[[], int]) -> None:
        from structllm.kernels.packed import BLOCK_TYPES, F16_CODE

        self._kernels, self.clock = kernels, clock
        self.active = False  # counting (the timed decode steps only)
        self.names = {v: k for k, v in BLOCK_TYPES.items()} | {F16_CODE: "F16"}
        self.ns: dict[tuple[str, str, int, int, int], int] = defaultdict(int)
        self.calls: dict[tuple[str, str, int, int, int], int] = defaultdict(int)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernels, name)

    def linear(self, x: Any, w: Any, code: int, mode: int) -> Any:
        if not self.active:
            return self._kernels.linear(x, w, code, mode)
        t0 = self.clock()
        y = self._kernels.linear(x, w, code, mode)
        key = (
            self.names[code],
            self.PATHS[mode],
            int(w.shape[0]),
            int(x.shape[1]),
            int(x.shape[0]),
        )
        self.ns[key] += self.clock() - t0
        self.calls[key] += 1
        return y

    def summary(self, steps: int) -> list[dict[str, Any]]:
        out = []
        for key, ns in sorted(self.ns.items(), key=lambda kv: -kv[1]):
            t, path, n, k, m = key
            per_call = ns / self.calls[key] / 1000
            out.append(
                {
                    "type": t,
                    "path": path,
                    "n": n,
                    "k": k,
                    "rows": m,
                    "us_per_call": round(per_call, 1),
                    "us_per_step": round(ns / steps / 1000, 1),
                    "ns_per_row_block": round(per_call * 1000 / (n * k / 32), 2),
                }
            )
        return out


class GcTimer:
    """Python's garbage collections during the timed steps: count, total and longest
    (their time is also inside whichever part was running; not taken off it)."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock, self.t0, self.pauses = clock, 0, [0] * 3
        self.by_gen: list[list[int]] = [[], [], []]

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.t0 = self.clock()
        else:
            self.by_gen[info["generation"]].append(self.clock() - self.t0)

    def summary(self, steps: int) -> dict[str, Any]:
        return {
            f"gen{g}": {
                "per_step": round(len(v) / steps, 3),
                "mean_us": round(sum(v) / len(v) / 1000, 1) if v else 0,
                "max_us": round(max(v) / 1000, 1) if v else 0,
            }
            for g, v in enumerate(self.by_gen)
        }


def decode_steps(
    core: Any,
    steps: int,
    seed: int,
    timers: Timers | None = None,
    rows: int = 1,
    by_matrix: ByMatrix | None = None,
) -> tuple[list[int], list[dict[str, int]]]:
    """Prefill ``rows`` requests (not timed), then ``steps`` decode steps of all of them:
    their wall times in ns and, with ``timers``, each step's time per label. (Prompts are
    prefilled in chunks beside other rows' decodes, so the requests stand at different
    token counts: each may run ``steps + rows`` tokens and the rest are aborted.)"""
    ids = [f"r{seed}-{i}" for i in range(rows)]
    for i, rid in enumerate(ids):
        add_request(core, rid, steps + (rows if rows > 1 else 0), seed * 1000 + i)
    prefill(core)
    times, parts = [], []
    clock = timers.clock if timers is not None else time.perf_counter_ns
    if by_matrix is not None:
        by_matrix.active = True
    for _ in range(steps):
        if timers is not None:
            timers.reset()
        t0 = clock()
        core.step()
        times.append(clock() - t0)
        if timers is not None:
            parts.append(dict(timers.ns))
    if by_matrix is not None:
        by_matrix.active = False
    core.abort(ids)
    while core.has_work:
        core.step()
    return times, parts


def kernels_alone(
    model: Any, reps: int, clock: Callable[[], int], rows: int = 1
) -> tuple[float, dict[str, float]]:
    """ns for every layer matmul and the LM head once at ``rows`` rows, back to back
    (median), and the same split by block type and path (``Q5_0 int16``, ``head Q8_0
    int16``...: each matmul, a fused matrix's parts each, timed alone; medians summed
    per key)."""
    import torch

    from structllm.kernels.packed import INT8_TYPES, BlockWeight, MixedWeight, linear

    jobs = []
    for layer in model.layers:
        for name in layer.PACKED:
            w = getattr(layer, name)
            jobs.append((w, name in ("gate_up_proj", "down_proj"), ""))
    head = model._packed_head if model._packed_head is not None else model.embed_tokens
    jobs.append((head, False, "head "))
    parts = []  # (key, weight, int8_ok): a mixed matrix's parts one by one
    for w, int8, tag in jobs:
        for p in w.parts if isinstance(w, MixedWeight) else [w]:
            if isinstance(p, BlockWeight):
                path = "int8" if int8 and p.type_name in INT8_TYPES else "int16"
                parts.append((f"{tag}{p.type_name} {path}", p, int8))
            else:  # float16 (fbgemm), float32 (oneDNN) matrices
                parts.append((f"{tag}{type(p).__name__}", p, int8))
    h = model.cfg.hidden_size
    inputs = {}
    with torch.inference_mode():
        for w, _, _ in jobs:
            k = w.shape[1] if hasattr(w, "shape") else h
            inputs.setdefault(k, torch.randn(rows, k))
        for w, int8, _ in jobs:  # warm-up (shapes; the int down_proj input is [rows, ffn])
            linear(inputs[_in_features(w, h)], w, int8_ok=int8)
        times = []
        for _ in range(reps):
            t0 = clock()
            for w, int8, _ in jobs:
                linear(inputs[_in_features(w, h)], w, int8_ok=int8)
            times.append(clock() - t0)
        each: dict[int, list[int]] = defaultdict(list)
        for _ in range(reps):
            for i, (_, p, int8) in enumerate(parts):
                x = inputs[_in_features(p, h)]
                t0 = clock()
                linear(x, p, int8_ok=int8)
                each[i].append(clock() - t0)
    by_key: dict[str, float] = defaultdict(float)
    for i, (key, _, _) in enumerate(parts):
        by_key[key] += statistics.median(each[i])
    return statistics.median(times), dict(by_key)


def _in_features(w: Any, h: int) -> int:
    shape = getattr(w, "shape", None)
    return int(shape[1]) if shape is not None else h


def timer_cost(clock: Callable[[], int], n: int = 2000) -> float:
    """ns a timed call adds to its parent's exclusive time (its wrapper and clock reads),
    the median of 5 rounds of ``n`` empty calls inside one timed parent."""
    timers = Timers(clock)
    child = timers.wrap("child", lambda: None)

    def parent() -> None:
        for _ in range(n):
            child()

    def bare() -> None:
        for _ in range(n):
            (lambda: None)()

    wrapped = timers.wrap("parent", parent)
    costs = []
    for _ in range(5):
        timers.reset()
        wrapped()
        t0 = clock()
        bare()
        loop = clock() - t0
        costs.append((timers.ns["parent"] + timers.ns["child"] - loop) / n)
    return statistics.median(costs)


def instrument(core: Any, timers: Timers) -> None:
    import structllm.model.llama as llama
    from structllm.kernels.attention import CpuAttention

    runner, model = core.runner, core.runner.model
    # the parts are timed at the Python loop's calls: the native decode loop
    # (model/decode_plan.py) has none to wrap, so timed steps take the Python loop (plain
    # steps keep the default; bench/thread_scaling.py --plan sets the two side by side)
    model.native_decode = False
    llama.linear = timers.wrap("matmul", llama.linear)  # type: ignore[assignment]
    CpuAttention.decode_rows = timers.wrap("attention", CpuAttention.decode_rows)  # type: ignore[method-assign]
    if model.cpu_ops is not None:
        model.cpu_ops = OpsProxy(model.cpu_ops, timers)
    model.compute_logits = timers.wrap("lm_head", model.compute_logits)
    model.forward = timers.wrap("forward_glue", model.forward)
    runner.sampler = timers.wrap("sampler", runner.sampler)
    runner.prepare = timers.wrap("prepare", runner.prepare)
    core.scheduler.schedule = timers.wrap("schedule", core.scheduler.schedule)
    core.scheduler.update = timers.wrap("update", core.scheduler.update)
    core.step = timers.wrap("step_other", core.step)


def engine_breakdown(
    path: str | None, steps: int, threads: int | None, cpu_clock: bool, rows: int = 1
) -> dict[str, Any]:
    import torch

    import structllm.kernels.packed as packed
    from structllm.config import EngineConfig, SpeculativeConfig
    from structllm.engine.core import EngineCore

    core = EngineCore(
        EngineConfig(
            model=path,
            max_num_seqs=rows,
            num_threads=threads,
            speculative_config=SpeculativeConfig(method="none"),
        )
    )
    model = core.runner.model
    clock = time.thread_time_ns if cpu_clock else time.perf_counter_ns
    decode_steps(core, 8, 1, rows=rows)  # warm-up
    plain, _ = decode_steps(core, steps, 2, Timers(clock), rows)  # (timers empty)
    kern, kern_by_type = kernels_alone(model, 20, clock, rows)
    per_call = timer_cost(clock)
    by_matrix = ByMatrix(packed._kernels(), clock)
    packed._KERNELS = by_matrix
    timers = Timers(clock)
    instrument(core, timers)
    gc_timer = GcTimer(clock)
    gc.callbacks.append(gc_timer)
    try:
        timed, per_step = decode_steps(core, steps, 3, timers, rows, by_matrix)
    finally:
        gc.callbacks.remove(gc_timer)
        packed._KERNELS = by_matrix._kernels
    calls = {k: v for k, v in timers.calls.items()}  # (the last step's)
    labels = {k for p in per_step for k in p}
    parts = {k: statistics.median(p.get(k, 0) for p in per_step) / 1000 for k in labels}
    return {
        "file": Path(path).name if path else "default",
        "rows": rows,
        "threads": torch.get_num_threads(),
        "clock": "thread CPU" if cpu_clock else "wall",
        "step_us_plain_median": statistics.median(plain) / 1000,
        "step_us_timed_median": statistics.median(timed) / 1000,
        "kernels_alone_us": kern / 1000,
        "kernels_by_type_us": {
            k: round(v / 1000, 1) for k, v in sorted(kern_by_type.items(), key=lambda kv: -kv[1])
        },
        "timer_us_per_call": per_call / 1000,
        "parts_us": {k: round(v, 1) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
        "calls_per_step": calls,
        "gc": gc_timer.summary(len(timed)),
        "by_matrix": [m for m in by_matrix.summary(len(timed)) if m["rows"] == rows],
    }


def print_breakdown(b: dict[str, Any]) -> None:
    total = b["step_us_timed_median"]
    print(
        f"{b['file']}: {b['rows']} rows: step {b['step_us_plain_median']:.0f} us plain, "
        f"{total:.0f} us timed "
        f"({b['clock']} time; medians, parts: each its median), torch threads {b['threads']}",
        file=sys.stderr,
    )
    for k, v in b["parts_us"].items():
        calls = b["calls_per_step"][k]
        print(
            f"  {k:14s} {v:8.1f} us  {100 * v / total:5.1f}%  ({calls:.0f} calls)", file=sys.stderr
        )
    timed_calls = sum(b["calls_per_step"].values())
    print(
        f"  (timers: ~{b['timer_us_per_call']:.2f} us a timed call, x{timed_calls} calls = "
        f"{b['timer_us_per_call'] * timed_calls:.0f} us a step, mostly in forward_glue)",
        file=sys.stderr,
    )
    for g, v in b["gc"].items():
        if v["per_step"]:
            print(
                f"  gc {g}: {v['per_step']} a step, mean {v['mean_us']} us, max {v['max_us']} us",
                file=sys.stderr,
            )
    kern = b["kernels_alone_us"]
    mm = b["parts_us"].get("matmul", 0) + b["parts_us"].get("lm_head", 0)
    print(
        f"  kernels alone  {kern:8.1f} us (every matmul once, back to back); step - kernels "
        f"= {b['step_us_plain_median'] - kern:.0f} us overhead, in-step matmul+head {mm:.0f} us",
        file=sys.stderr,
    )
    by_type = "  ".join(f"{k} {v:.0f}" for k, v in b.get("kernels_by_type_us", {}).items())
    print(f"  kernels by type (us, each alone): {by_type}", file=sys.stderr)
    for m in b["by_matrix"]:
        print(
            f"  {m['type']:6s} {m['path']:5s} {m['n']:6d}x{m['k']:<5d} "
            f"{m['us_per_call']:8.1f} us a call, {m['us_per_step']:8.1f} us a step, "
            f"{m['ns_per_row_block']:6.2f} ns a row-block",
            file=sys.stderr,
        )


def trace_steps(path: str, offset: int) -> list[tuple[int, int]]:
    """The engine's step spans (start us, duration us) in a trace file after ``offset``."""
    spans = []
    with open(path) as f:
        f.seek(offset)
        for line in f:
            line = line.strip().rstrip(",")
            if not line.startswith("{"):
                continue
            e = json.loads(line)
            if e.get("name") == "step" and e.get("ph") == "X":
                spans.append((e["ts"], e["dur"]))
    return spans


def stream_one(url: str, steps: int, seed: int) -> tuple[list[float], dict[str, Any]]:
    """One streamed greedy request: the client's ITLs (s) and the last chunk's timings."""
    import random

    import httpx

    rng = random.Random(seed)
    body = {
        "prompt": [rng.randrange(100, 49052) for _ in range(PROMPT_LEN)],
        "max_tokens": steps,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    itls: list[float] = []
    timings: dict[str, Any] = {}
    last = None
    with (
        httpx.Client(timeout=120) as c,
        c.stream("POST", url + "/v1/completions", json=body) as resp,
    ):
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            timings = data.get("timings") or timings
            if any(ch.get("text") for ch in data.get("choices", [])):
                now = time.perf_counter()
                if last is not None:
                    itls.append(now - last)
                last = now
    return itls, timings


def cpu_groups(name: str, pid: int) -> dict[str, list[int]]:
    """The processes whose CPU time a server's stream is charged: llama-server itself;
    structllm's front end (server process, extra front ends) and its engine apart."""
    import serve

    if name == "llama.cpp":
        return {"server": [pid]}
    engine = serve.engine_pid(pid)
    return {"front": serve.front_end_pids(pid), "engine": [engine] if engine else []}


def serve_compare(path: str | None, a: argparse.Namespace) -> dict[str, Any]:
    import serve

    fd, trace = tempfile.mkstemp(prefix="step-breakdown-", suffix=".jsonl")
    os.close(fd)
    args = [*(([path]) if path else []), "--trace", trace]
    ns = argparse.Namespace(max_concurrency=1, kv_tokens=0, server_args=args)
    servers: dict[str, Any] = {"structllm": serve.launch(ns)}
    if a.base_tree:  # the same server from another source tree (a baseline commit)
        env = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.path.abspath(a.base_tree)
        try:
            # traced too (its own file, not read): tracing costs both arms alike
            base_args = [*args[:-1], trace + ".base"]
            ns = argparse.Namespace(max_concurrency=1, kv_tokens=0, server_args=base_args)
            servers["structllm-base"] = serve.launch(ns)
        finally:
            if env is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = env
    llama = None
    if a.llama_server:
        ns = argparse.Namespace(
            llama_server=a.llama_server,
            llama_model=path,
            max_concurrency=1,
            kv_tokens=0,
            input_len=PROMPT_LEN,
            output_len=a.steps,
        )
        llama = serve.launch_llama(ns)
        servers["llama.cpp"] = (llama.proc, llama.url)
    got: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in servers}
    try:
        for _, url in servers.values():
            stream_one(url, 8, 7)  # warm-up
        names = list(servers)
        for rep in range(a.reps):
            # the order rotates: no arm always follows the same one (llama-server's threads
            # spin on for a while after a stream, slowing whichever arm comes next)
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                proc, url = servers[name]
                mark = os.path.getsize(trace)
                groups = cpu_groups(name, proc.pid)
                cpu0 = {k: serve.cpu_seconds(v) for k, v in groups.items()}
                itls, timings = stream_one(url, a.steps, 100 + rep)
                got[name]["itl_ms"].append(1000 * statistics.median(itls))
                for k, v in groups.items():  # CPU per token, all threads of the processes
                    used = serve.cpu_seconds(v) - cpu0[k]
                    got[name][f"{k}_cpu_ms_per_token"].append(1000 * used / a.steps)
                if name == "llama.cpp" and timings.get("predicted_per_token_ms"):
                    got[name]["compute_ms"].append(timings["predicted_per_token_ms"])
                if name == "structllm":
                    spans = trace_steps(trace, mark)[2:]  # the prompt's step, the first decode
                    got[name]["compute_ms"].append(statistics.median(d for _, d in spans) / 1000)
                    period = [b[0] - a_[0] for a_, b in itertools.pairwise(spans)]
                    got[name]["period_ms"].append(statistics.median(period) / 1000)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            proc.wait(timeout=60)
        if llama is not None:
            llama.stop()  # (its output file closed)
        for f in (trace, trace + ".base"):
            if os.path.exists(f):
                os.unlink(f)
    return {k: {m: round(statistics.median(v), 3) for m, v in d.items()} for k, d in got.items()}


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("files", nargs="*", help="GGUF files (default: the default model)")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rows", type=int, default=1, help="requests decoding together")
    ap.add_argument("--reps", type=int, default=3, help="--serve: streams per server")
    ap.add_argument("--threads", type=int, default=None, help="the engine's torch threads")
    ap.add_argument(
        "--cpu-clock", action="store_true", help="time parts in thread CPU time (--threads 1)"
    )
    ap.add_argument("--serve", action="store_true", help="also through the HTTP server")
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process breakdown")
    ap.add_argument("--llama-server", default=None, help="--serve: compare with llama-server")
    ap.add_argument(
        "--base-tree",
        default=None,
        help="--serve: also structllm from this source tree (`git archive BASE | tar -x -C DIR`)",
    )
    a = ap.parse_args()
    from structllm.threads import apply_to_this_process

    apply_to_this_process()  # the engine's OpenMP wait policy, before torch loads
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    files: list[str | None] = list(a.files) or [None]
    cpuinfo = Path("/proc/cpuinfo").read_text()
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if "model name" in ln), "?"
    )
    print(f"# {cpu}, {os.cpu_count()} cores, avx512f {'avx512f' in cpuinfo}", file=sys.stderr)
    rows = []
    for path in files:
        row: dict[str, Any] = {"file": Path(path).name if path else "default"}
        row["load"] = [Path("/proc/loadavg").read_text().split()[0]]
        print(row["file"], file=sys.stderr)
        if not a.no_engine:
            row["engine"] = engine_breakdown(path, a.steps, a.threads, a.cpu_clock, a.rows)
            print_breakdown(row["engine"])
        if a.serve:
            row["serve"] = serve_compare(path, a)
            for name, figs in row["serve"].items():
                extra = "  ".join(f"{k} {v:.2f}" for k, v in figs.items())
                print(f"  {name:10s} {extra}", file=sys.stderr)
        row["load"].append(Path("/proc/loadavg").read_text().split()[0])
        print(f"  load average {row['load'][0]} -> {row['load'][1]}", file=sys.stderr)
        rows.append(row)
    print(json.dumps({"bench": "step_breakdown", "cpu": cpu, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
