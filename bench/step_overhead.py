r"""The batch-1 decode step's overhead: what a step costs outside the layer and matmul
kernels (issue #46: under 0.3 ms a step).

    python bench/step_overhead.py [FILE.gguf ...] [--steps 128] [--threads N]
        [--clock cpu|wall]

For each GGUF file (default: the default model), an offline ``LLM`` (speculation off)
generates one greedy request of ``--steps`` tokens (a 64-token prompt, EOS ignored),
taking the default decode path (the native decode loop where it applies), with every
phase of the generate loop timed (``perf_counter_ns`` or this thread's CPU time around
it, exclusive of the phases timed inside it):

- kernels: ``layers`` (the native decode loop's calls, or with the Python loop the
  model's matmuls, attention and fused ops), ``lm_head`` (the head's matmul), ``norm``
  (the final fused norm);
- overhead: ``schedule`` and ``update`` (the scheduler, KV block bookkeeping),
  ``prepare`` (``ModelRunner.prepare``: the flat batch and its tensors), ``forward_glue``
  (``LlamaModel.forward`` around the kernels: embedding row, rotary rows, views),
  ``logits_glue`` (``compute_logits`` around the head), ``runner_glue`` (the rest of
  ``ModelRunner.execute``), ``sampler``, ``step_other`` (the rest of
  ``EngineCore.step``: stats, the output batch), ``output`` (the offline loop's
  ``SequenceState.process``: detokenisation, stop checks; the front end's in a server),
  ``loop`` (the rest of ``LLM._run``'s loop, what no phase covers);
- ``ipc_encode`` / ``ipc_decode``: the step's ``OutputBatch`` as the engine process
  encodes it for its ring and the front end decodes it (msgspec, the channel's own
  encoder and decoder types), timed on each step's batch after the step (a server's
  cost; not in the offline loop, so not in its wall time).

Per-step medians over the decode steps (the prompt's step left out). The figure for
the issue is the sum of the overhead phases; ``--clock cpu`` (the default) times them
in this thread's CPU time, which the machine's load inflates far less than wall time
(the load average is printed). ``step wall`` is the plain step's wall time (a run
without the timers), the context for the shares.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_breakdown, beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's structllm

from step_breakdown import PROMPT_LEN, Timers

KERNELS = ("layers", "lm_head", "norm")
OVERHEAD = (
    "schedule",
    "prepare",
    "forward_glue",
    "logits_glue",
    "runner_glue",
    "sampler",
    "update",
    "step_other",
    "output",
    "loop",
)
IPC = ("ipc_encode", "ipc_decode")


class NativeProxy:
    """The native decode plan (a pybind object) with its ``run`` timed."""

    def __init__(self, native: Any, timed: Callable[..., Any]) -> None:
        self._native, self.run = native, timed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)


class OpsProxy:
    """The fused layer ops with ``rms_norm`` (the final norm, on the native path) timed
    as ``norm`` and the rest as ``layers`` (the Python layer loop's ops)."""

    def __init__(self, ops: Any, timers: Timers) -> None:
        self._ops, self._timers = ops, timers

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn
        return self._timers.wrap("norm" if name == "rms_norm" else "layers", fn)


def instrument(llm: Any, timers: Timers) -> Callable[[], None]:
    """Wrap the phases of ``llm``'s generate loop; returns what undoes it."""
    import structllm.model.llama as llama
    from structllm.kernels.attention import CpuAttention
    from structllm.output import SequenceState

    core = llm.engine
    runner, model = core.runner, core.runner.model
    saved_linear, saved_decode = llama.linear, CpuAttention.decode_rows
    saved_process = SequenceState.process
    llama.linear = timers.wrap("lm_head", llama.linear)  # type: ignore[assignment]
    CpuAttention.decode_rows = timers.wrap("layers", CpuAttention.decode_rows)  # type: ignore[method-assign]
    SequenceState.process = timers.wrap("output", SequenceState.process)  # type: ignore[method-assign]
    plan = model._native_plan()
    if plan is not None:
        plan.native = NativeProxy(plan.native, timers.wrap("layers", plan.native.run))
    if model.cpu_ops is not None:
        model.cpu_ops = OpsProxy(model.cpu_ops, timers)
    for obj, name, label in (
        (model, "compute_logits", "logits_glue"),
        (model, "forward", "forward_glue"),
        (runner, "sampler", "sampler"),
        (runner, "prepare", "prepare"),
        (runner, "execute", "runner_glue"),
        (core.scheduler, "schedule", "schedule"),
        (core.scheduler, "update", "update"),
        (core, "step", "step_other"),
    ):
        setattr(obj, name, timers.wrap(label, getattr(obj, name)))

    def undo() -> None:
        llama.linear = saved_linear  # type: ignore[assignment]
        CpuAttention.decode_rows = saved_decode  # type: ignore[method-assign]
        SequenceState.process = saved_process  # type: ignore[method-assign]

    return undo


class StepLog:
    """Snapshots of the timers at each ``EngineCore.step`` call: one iteration of the
    generate loop lies between two calls. Also times each step's ``OutputBatch``
    through the channel's encoder and the front end's decoder (outside the loop's
    time: each snapshot is taken after them)."""

    def __init__(self, core: Any, timers: Timers) -> None:
        import msgspec

        from structllm.protocol import FromEngine

        self.timers = timers
        self.marks: list[tuple[int, dict[str, int]]] = []
        self.ipc: list[dict[str, int]] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: Any = msgspec.msgpack.Decoder(FromEngine)
        step = core.step

        def logged(*args: Any, **kwargs: Any) -> Any:
            clock = timers.clock
            self.marks.append((clock(), dict(timers.ns)))
            batch = step(*args, **kwargs)
            t0 = clock()
            frame = self._encoder.encode(batch)
            t1 = clock()
            self._decoder.decode(frame)
            t2 = clock()
            self.ipc.append({"ipc_encode": t1 - t0, "ipc_decode": t2 - t1})
            # the snapshot at the next call takes the IPC time off (not the loop's)
            self._skip = t2 - t0
            return batch

        self._skip = 0
        core.step = logged

    def per_step(self) -> list[dict[str, int]]:
        """Each iteration's ns per phase (``loop``: what no phase covers); the IPC
        figures of the step it ran, apart."""
        out = []
        for i, ((t0, a), (t1, b)) in enumerate(zip(self.marks, self.marks[1:], strict=False)):
            parts = {k: b.get(k, 0) - a.get(k, 0) for k in b}
            wall = t1 - t0 - self.ipc[i]["ipc_encode"] - self.ipc[i]["ipc_decode"]
            parts["loop"] = wall - sum(parts.values())
            parts["iteration"] = wall
            parts.update(self.ipc[i])
            out.append(parts)
        return out


def generate(llm: Any, steps: int, seed: int, clocked: bool = True) -> float:
    """One greedy request of ``steps`` tokens; returns the wall time per output token
    after the first (the decode steps' mean; ``clocked`` False: 0, nothing added to the
    loop)."""
    import random

    from structllm.protocol import SamplingParams

    rng = random.Random(seed)
    vocab = llm.engine.vocab_size
    prompt = [rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)]
    sp = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    if not clocked:
        llm.generate([prompt], sp)
        return 0.0
    first: list[float] = []
    step = llm.engine.step

    def timed(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        if not first:
            first.append(time.perf_counter())
        return out

    llm.engine.step = timed
    try:
        llm.generate([prompt], sp)
    finally:
        llm.engine.step = step
    return (time.perf_counter() - first[0]) / max(1, steps - 1)


def measure(path: str | None, steps: int, threads: int | None, clock_name: str) -> dict[str, Any]:
    import torch

    from structllm.llm import LLM

    llm = LLM(
        path,
        max_num_seqs=1,
        num_threads=threads,
        speculative_config={"method": "none"},
    )
    model = llm.engine.runner.model
    generate(llm, 8, 1)  # warm-up (the native plan is built)
    plain = [generate(llm, steps, 2 + i) for i in range(2)]
    clock = time.thread_time_ns if clock_name == "cpu" else time.perf_counter_ns
    timers = Timers(clock)
    undo = instrument(llm, timers)
    log = StepLog(llm.engine, timers)
    try:
        generate(llm, steps, 9, clocked=False)
    finally:
        undo()
    rows = log.per_step()[1:]  # the prompt's step left out (and the loop's last, none)
    labels = {k for r in rows for k in r}
    med = {k: statistics.median(r.get(k, 0) for r in rows) / 1000 for k in labels}
    mean = {k: statistics.fmean(r.get(k, 0) for r in rows) / 1000 for k in labels}
    return {
        "file": Path(path).name if path else "default",
        "decode_path": model.decode_path,
        "threads": torch.get_num_threads(),
        "clock": clock_name,
        "steps": len(rows),
        "step_wall_us": 1e6 * statistics.median(plain),
        "median_us": {k: round(v, 1) for k, v in med.items()},
        "mean_us": {k: round(v, 1) for k, v in mean.items()},
        "overhead_us": round(sum(med.get(k, 0) for k in OVERHEAD), 1),
        "overhead_mean_us": round(sum(mean.get(k, 0) for k in OVERHEAD), 1),
        "engine_overhead_us": round(
            sum(med.get(k, 0) for k in OVERHEAD if k not in ("output", "loop"))
            + med.get("ipc_encode", 0),
            1,
        ),
    }


def print_table(r: dict[str, Any]) -> None:
    med, mean = r["median_us"], r["mean_us"]
    print(
        f"{r['file']}: {r['decode_path']} decode loop, {r['threads']} threads, "
        f"{r['clock']} clock, {r['steps']} steps; plain step {r['step_wall_us']:.0f} us wall",
        file=sys.stderr,
    )
    print(f"  {'phase':14s} {'median us':>10s} {'mean us':>9s}", file=sys.stderr)
    for group, keys in (("kernels", KERNELS), ("overhead", OVERHEAD), ("server only", IPC)):
        print(f"  -- {group}", file=sys.stderr)
        for k in keys:
            print(f"  {k:14s} {med.get(k, 0):10.1f} {mean.get(k, 0):9.1f}", file=sys.stderr)
    print(
        f"  overhead (sum of its phases' medians) {r['overhead_us']:.0f} us, means "
        f"{r['overhead_mean_us']:.0f} us; the engine thread's in a server (no output/loop, "
        f"+ ipc_encode) {r['engine_overhead_us']:.0f} us; iteration {med['iteration']:.0f} us",
        file=sys.stderr,
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("files", nargs="*", help="GGUF files (default: the default model)")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="the engine's torch threads")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    a = ap.parse_args()
    from structllm.threads import apply_to_this_process

    apply_to_this_process()  # the engine's OpenMP wait policy, before torch loads
    load = [Path("/proc/loadavg").read_text().split()[0]]
    results = []
    for path in list(a.files) or [None]:
        r = measure(path, a.steps, a.threads, a.clock)
        print_table(r)
        results.append(r)
    load.append(Path("/proc/loadavg").read_text().split()[0])
    print(f"load average {load[0]} -> {load[1]}, {os.cpu_count()} cores", file=sys.stderr)
    print(json.dumps({"bench": "step_overhead", "load": load, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
