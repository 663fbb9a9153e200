r"""What a second thread buys a decode step, part by part, in one process.

    python bench/thread_scaling.py [FILE.gguf ...] [--steps 48] [--rounds 3] [--rows 1]
    python bench/thread_scaling.py [FILE.gguf ...] --plan  # native decode loop on/off

For each GGUF file (default: the default model) one engine is loaded with two threads,
then rounds of 1 thread / 2 threads alternate (``torch.set_num_threads``: the kernel pool
reads it every loop), so that both arms see the same load:

- ``step``: a plain decode step's wall time (median), and the same step with each part
  timed (``step_breakdown.py``'s labels: matmul, lm_head, attention, layer_ops,
  forward_glue, ...): the serial fraction is what does not shrink at 2 threads;
- ``kernels alone``: every matmul once, back to back (the weights stream from memory);
- layer 0's matrices one at a time in a loop (cache-resident: the pool's split and
  dispatch without the memory), per call;
- ``pool probe``: ``soft_cap_`` on 2 x 16384 floats, two equal chunks: at 2 threads,
  time - (1-thread time) / 2 is what one dispatch costs (wake, claims, join);
- ``stream``: a float32 sum over 256 MB (torch's threads): memory bandwidth.

Where the quant module has ``prefetch_hints``, a third arm ``2t-`` runs two threads with
the workers not prefetching the next matmul's weights (``cpu_pool.h``), to measure them.
Prints per item the 1- and 2-thread medians (min over rounds) and the speed-up, and
the load average: the figures are wall time, so a loaded machine makes them noisy.

``--plan``: instead, a plain decode step with the native layer loop (``model/
decode_plan.py``) off and on, at 1 and 2 threads, the four arms interleaved (off, on,
off, on, ...) in each round; median per arm (min over rounds) and on/off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_breakdown import Timers, decode_steps, instrument, kernels_alone


def per_call(fn: Any, n: int, reps: int = 5) -> float:
    """us per call of fn: the median over reps loops of n calls."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter_ns() - t0) / n / 1000)
    return statistics.median(ts)


def probes(model: Any, ops: Any, big: Any) -> dict[str, float]:
    import torch

    from structllm.kernels.packed import linear

    out: dict[str, float] = {}
    layer = model.layers[0]
    h = model.cfg.hidden_size
    for name in layer.PACKED:
        w = getattr(layer, name)
        x = torch.randn(1, w.shape[1] if hasattr(w, "shape") else h)
        int8 = name in ("gate_up_proj", "down_proj")
        out[f"L0 {name} x1"] = per_call(lambda w=w, x=x, i=int8: linear(x, w, int8_ok=i), 200)
    out["kernels alone"] = kernels_alone(model, 5, time.perf_counter_ns)[0] / 1000
    if ops is not None:
        x = torch.randn(2 * 16384)
        out["pool probe"] = per_call(lambda: ops.soft_cap_(x.view(2, -1), 30.0), 500)
    out["stream 256MB"] = per_call(lambda: big.sum(), 3, 3)
    return out


def set_arm(quant: Any, threads: int, prefetch: bool) -> None:
    import torch

    torch.set_num_threads(threads)
    if hasattr(quant, "prefetch_hints"):
        quant.prefetch_hints(prefetch)


def plain_core(path: str | None, rows: int) -> Any:
    """An engine on ``path`` with two threads and plain decode steps (no drafts: the
    steps timed are the model's)."""
    from structllm.config import EngineConfig, SpeculativeConfig
    from structllm.engine.core import EngineCore

    spec = SpeculativeConfig(method="none")
    return EngineCore(
        EngineConfig(model=path, max_num_seqs=rows, num_threads=2, speculative_config=spec)
    )


def run_file(path: str | None, steps: int, rounds: int, rows: int) -> None:
    import torch

    from structllm.kernels import cpu_ext

    core = plain_core(path, rows)
    model = core.runner.model
    ops = cpu_ext.load_layer()
    big = torch.ones(64 << 20)
    decode_steps(core, 8, 1, rows=rows)  # warm-up
    quant = cpu_ext.load_quant()
    # arms: threads, and whether the workers prefetch the next matmul's weights
    arms = [(1, True), (2, True)] + ([(2, False)] if hasattr(quant, "prefetch_hints") else [])
    res: dict[tuple[str, Any], list[float]] = defaultdict(list)
    load0 = Path("/proc/loadavg").read_text().split()[0]
    for r in range(rounds):
        for i, arm in enumerate(arms):
            set_arm(quant, *arm)
            plain, _ = decode_steps(core, steps, 10 + r * 3 + i, rows=rows)
            res[("step plain", arm)].append(statistics.median(plain) / 1000)
            with torch.inference_mode():
                for k, v in probes(model, ops, big).items():
                    res[(k, arm)].append(v)
    timers = Timers()
    instrument(core, timers)  # from here on every step is timed
    for r in range(rounds):
        for i, arm in enumerate(arms):
            set_arm(quant, *arm)
            timed, parts = decode_steps(core, steps, 100 + r * 3 + i, timers, rows)
            res[("step timed", arm)].append(statistics.median(timed) / 1000)
            for label in {k for p in parts for k in p}:
                res[(f"  {label}", arm)].append(
                    statistics.median(p.get(label, 0) for p in parts) / 1000
                )
    set_arm(quant, 2, True)
    load1 = Path("/proc/loadavg").read_text().split()[0]
    name = Path(path).name if path else "default"
    print(f"{name}: {rows} rows, wall us (min over {rounds} rounds), load {load0} -> {load1}")
    keys = list(dict.fromkeys(k for k, _ in res))
    if len(arms) > 2:
        print("  (2t-: two threads, the workers not prefetching the next matmul's weights)")
    for k in keys:
        a, b = min(res[(k, (1, True))]), min(res[(k, (2, True))])
        extra = ""
        if len(arms) > 2:
            c = min(res[(k, (2, False))])
            extra += f"  2t- {c:9.1f}  x{a / c:5.2f}"
        if k == "pool probe":
            extra += f"  (dispatch ~{b - a / 2:.1f} us)"
        print(f"  {k:24s} 1t {a:9.1f}  2t {b:9.1f}  x{a / b:5.2f}{extra}")


def run_plan_ab(path: str | None, steps: int, rounds: int, rows: int) -> None:
    import torch

    core = plain_core(path, rows)
    model = core.runner.model
    decode_steps(core, 8, 1, rows=rows)  # warm-up (builds the plan)
    res: dict[tuple[int, bool], list[float]] = defaultdict(list)
    load0 = Path("/proc/loadavg").read_text().split()[0]
    for r in range(rounds):
        for i, (threads, native) in enumerate([(1, False), (1, True), (2, False), (2, True)]):
            torch.set_num_threads(threads)
            model.native_decode = native
            times, _ = decode_steps(core, steps, 10 + r * 4 + i, rows=rows)
            res[(threads, native)].append(statistics.median(times) / 1000)
    torch.set_num_threads(2)
    model.native_decode = True
    load1 = Path("/proc/loadavg").read_text().split()[0]
    name = Path(path).name if path else "default"
    print(f"{name}: {rows} rows, decode step wall us (median, min over {rounds} rounds)")
    print(f"  path taken: {model.decode_path}; load {load0} -> {load1}")
    for threads in (1, 2):
        off, on = min(res[(threads, False)]), min(res[(threads, True)])
        print(
            f"  {threads}t  python loop {off:8.1f}  native loop {on:8.1f}  on/off x{on / off:5.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("files", nargs="*")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--plan", action="store_true", help="native decode loop off vs on")
    args = ap.parse_args()
    for f in args.files or [None]:
        (run_plan_ab if args.plan else run_file)(f, args.steps, args.rounds, args.rows)


if __name__ == "__main__":
    main()
