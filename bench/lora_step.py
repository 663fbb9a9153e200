r"""Where a LoRA decode step's time goes: the step, and LoRA's kernels alone.

    python bench/lora_step.py [FILE.gguf] [--rows 16] [--steps 12] [--rounds 3] [--rank 16]
                              [--lora-dtype auto] [--cpu-clock]

On the default model (or FILE), ``--rows`` requests decode together through
``EngineCore``; the median wall time of ``--steps`` decode steps, for each of

- ``base``: no request with an adapter; ``one``: every request with the same
  rank-``--rank`` adapter; ``distinct``: each request its own;
- ``native`` (the native decode loop, cpu_decode.cpp, adding the adapters itself) and
  ``python`` (``model.native_decode = False``: the Python layer loop, which calls
  ``LoraRows.add`` after each matmul; the time inside those calls is printed too).

Then ``kernels``: the LoRA additions of one step alone (every layer's four projections
through ``lora_add``, the adapters' weights as loaded, x and out of the step's shapes),
for ``one`` and ``distinct``, with cpu_lora.h's defaults (blocks of 8 rows, one pass
from one block a thread), with two passes forced (``fuse_blocks_per_thread`` huge) and
with blocks of 16 rows (``rows_per_block``, the earlier size): milliseconds per step
(the median of ``--steps`` passes) and the adapters' bytes read per second. Rounds
interleave every arm; per arm the best round.
``--base REV``: the kernels arms again with ``cpu_lora.cpp`` and its headers as of git
revision REV (built like any kernel, cached), over the same adapters (A handed over as
``[r, K]`` where REV's kernel takes it so): an A/B of a kernel change in one run.
Wall time on a loaded machine is noisy: compare within one run. ``--cpu-clock``: one
kernel thread, and every figure in the calling thread's CPU time (which the kernels then
run on), far less inflated by other processes than wall time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


CLOCK = time.perf_counter  # --cpu-clock: time.thread_time
# the kernels' arms: cpu_lora.h's (fuse_blocks_per_thread, rows_per_block)
KNOBS = {
    "default": (1, 8),
    "two passes": (1 << 40, 8),
    "16 rows a block": (4, 16),
}


def step_arm(core: Any, refs: list[Any], which: str, steps: int, timed: list[int]) -> float:
    """Median ms of ``steps`` decode steps of ``len(refs)`` requests (``which``)."""
    from structllm.protocol import AddRequest, SamplingParams

    rng = random.Random(1)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i, ref in enumerate(refs):
        ids = [rng.randrange(100, 20000) for _ in range(64)]
        lora = None if which == "base" else refs[0] if which == "one" else ref
        core.add_request(AddRequest(f"{which}{time.monotonic_ns()}-{i}", ids, params, lora=lora))
    sched = core.scheduler
    while sched.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in sched.running):
        core.step()
    core.step()
    times, timed[0] = [], 0
    for _ in range(steps):
        t = CLOCK()
        core.step()
        times.append(CLOCK() - t)
    while sched.running or sched.waiting:
        core.step()
    return statistics.median(times) * 1e3


def kernel_arm(
    model: Any, rows: Any, t: int, knobs: tuple[int, int], native: Any, repeat: int
) -> float:
    """Median ms of one step's LoRA additions (every layer's projections) for ``rows`` of
    a ``t``-row batch, over ``repeat`` passes."""
    import torch

    from structllm.model.lora import layout

    cfg = model.cfg
    shapes = {}
    for proj in ("qkv", "o", "gate_up", "down"):
        k, parts = layout(cfg, proj)
        shapes[proj] = (k, sum(n for _, n in parts))
    bufs = {p: (torch.randn(t, k), torch.zeros(t, n)) for p, (k, n) in shapes.items()}
    was = native.fuse_blocks_per_thread(knobs[0]), native.rows_per_block(knobs[1])
    try:
        times = []
        for _ in range(repeat):
            start = CLOCK()
            for layer in range(cfg.num_layers):
                for proj, (x, out) in bufs.items():
                    rows.add(layer, proj, x, out)
            times.append(CLOCK() - start)
        return statistics.median(times) * 1e3
    finally:
        native.fuse_blocks_per_thread(was[0]), native.rows_per_block(was[1])


def base_module(rev: str) -> tuple[Any, bool]:
    """``cpu_lora.cpp`` as of git revision ``rev`` (with its headers), built for the best
    ISA, cached like any kernel (one directory per revision); and whether it takes A as
    ``[r, K]`` (before the A^T layout, whose header names RANK_ALIGN)."""
    import subprocess

    from structllm.kernels import cpu_ext
    from structllm.paths import cache_root

    root = Path(__file__).resolve().parents[1]
    d = cache_root() / "bench" / f"lora_{rev}"
    d.mkdir(parents=True, exist_ok=True)
    for name in ("cpu_lora.cpp", "cpu_lora.h", "cpu_pool.h", "cpu_simd.h"):
        src = ["git", "-C", str(root), "show", f"{rev}:structllm/kernels/{name}"]
        (d / name).write_bytes(subprocess.run(src, check=True, capture_output=True).stdout)
    isa = cpu_ext.best_isa()
    assert isa is not None
    flags = [*cpu_ext.FLAGS, cpu_ext._ISA_MARCH[isa]]
    module = cpu_ext.build(f"structllm_lora_base_{isa}", d / "cpu_lora.cpp", flags, f"{rev}'s LoRA")
    if module is None:
        raise RuntimeError(f"could not build cpu_lora.cpp at {rev}")
    return cpu_ext._share_pool(module), b"RANK_ALIGN" not in (d / "cpu_lora.h").read_bytes()


def base_rows(rows: Any, module: Any, num_layers: int, a_rows: bool) -> Any:
    """``rows`` with ``module``'s ``lora_add`` and its items made ahead for every layer;
    ``a_rows``: A as ``[r, K]`` (the kernels before A^T)."""
    import dataclasses

    from structllm.model.lora import LoraPlans

    out = dataclasses.replace(rows, native=module, plans=LoraPlans())
    for layer in range(num_layers):
        for proj in ("qkv", "o", "gate_up", "down"):
            items: Any = ([], [], [], [])
            for g, (adapter, _) in enumerate(rows.groups):
                for at, bt, col in adapter.layers.get(layer, {}).get(proj, ()):
                    items[0].append(at.t().contiguous() if a_rows else at)
                    items[1].append(bt)
                    items[2].append(col)
                    items[3].append(g)
            out.plans.items[layer, proj] = items
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lora-dtype", default="auto")
    ap.add_argument("--cpu-clock", action="store_true", help="one thread, thread CPU time")
    ap.add_argument("--base", default=None, help="git revision of a baseline cpu_lora.cpp")
    a = ap.parse_args()
    if a.cpu_clock:
        import torch

        global CLOCK
        CLOCK = time.thread_time
        torch.set_num_threads(1)

    import os

    from bench.lora import write_adapter
    from structllm.config import EngineConfig, SpeculativeConfig
    from structllm.engine.core import EngineCore
    from structllm.model import lora as lora_mod
    from structllm.protocol import LoraRef

    core = EngineCore(
        EngineConfig(
            model=a.model,
            kv_cache_memory=256 << 20,
            enable_lora=True,
            max_loras=a.rows,
            max_cpu_loras=a.rows,
            max_lora_rank=max(16, a.rank),
            lora_dtype=a.lora_dtype,
            speculative_config=SpeculativeConfig(method="none"),
        )
    )
    model, registry = core.runner.model, core.adapters  # type: ignore[union-attr]
    assert registry is not None and registry.native is not None, "no native LoRA kernel"
    tmp = Path(tempfile.mkdtemp())
    refs = [
        LoraRef(f"a{i}", i + 1, str(write_adapter(tmp / f"a{i}", model.cfg, a.rank, i)))
        for i in range(a.rows)
    ]
    timed = [0]
    add = lora_mod.LoraRows.add

    def timed_add(self: Any, *args: Any) -> None:
        t = CLOCK()
        add(self, *args)
        timed[0] += int((CLOCK() - t) * 1e9)

    lora_mod.LoraRows.add = timed_add  # type: ignore[method-assign]
    # the kernels' rows: one adapter on every row, or one each
    pinned = [registry.acquire(r) for r in refs]
    base, a_rows = base_module(a.base) if a.base else (None, False)
    kernel_rows = {
        "one": registry.rows([(pinned[0].uid, a.rows)]),
        "distinct": registry.rows([(p.uid, 1) for p in pinned]),
    }
    nbytes = {"one": pinned[0].nbytes, "distinct": sum(p.nbytes for p in pinned)}
    steps: dict[str, list[tuple[float, float]]] = {}
    kernels: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        for which in ("base", "one", "distinct"):
            for native in (True, False):
                model.native_decode = native
                ms = step_arm(core, refs, which, a.steps, timed)
                key = f"{which} {'native' if native else 'python'}"
                steps.setdefault(key, []).append((ms, timed[0] / a.steps / 1e6))
        model.native_decode = True
        for which, rows in kernel_rows.items():
            for label, knobs in KNOBS.items():
                ms = kernel_arm(model, rows, a.rows, knobs, registry.native, a.steps)
                kernels.setdefault(f"{which} {label}", []).append(ms)
                if base is not None:
                    rows_b = base_rows(rows, base, model.cfg.num_layers, a_rows)
                    ms = kernel_arm(model, rows_b, a.rows, knobs, base, a.steps)
                    kernels.setdefault(f"{which} {label} @{a.base}", []).append(ms)
    load = os.getloadavg()[0]
    clock = "thread CPU time, one thread" if a.cpu_clock else "wall time"
    print(
        f"load average {load:.1f}; {a.rows} rows, rank {a.rank}, {a.lora_dtype} adapters; {clock}"
    )
    print(f"decode loop: {model.decode_why}")
    first = min(ms for ms, _ in steps["base native"])
    for key, runs in steps.items():
        ms, lora_ms = min(runs)
        inside = f"  (LoraRows.add: {lora_ms:6.1f} ms)" if key.endswith("python") else ""
        print(f"{key:>16}: step {ms:7.1f} ms  {ms / first:5.2f}x base native{inside}")
    for key, runs in kernels.items():
        ms = min(runs)
        gbs = nbytes[key.split()[0]] / ms / 1e6
        print(f"kernels {key:>34}: {ms:7.1f} ms/step  adapters read at {gbs:5.1f} GB/s")
    for p in pinned:
        registry.release(p.uid)
    core.close()


if __name__ == "__main__":
    main()
