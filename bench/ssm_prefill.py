r"""Mamba-2's prefill scan, one layer at the bench models' shapes: thread CPU time of one
step's prompt rows through the native kernel (``cpu_recurrent.cpp``'s ``ssm_prefill``,
the recurrence token by token) against torch's chunked form (``Mamba2._torch_scan`` ->
``ssd`` -> ``_ssd_chunked``), on one kernel thread, interleaved, median of ``--reps``.

    python bench/ssm_prefill.py [--lengths 32x16,256,2048] [--reps 5]

A length ``LxK`` is ``K`` sequences of ``L`` rows in one step (16 x 32: the 16-stream
run's prompts). Granite 4's shape: 32 heads of 64, one group, state 128, chunk 256;
Nemotron-H's: the same with 8 groups and chunk 128.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's structllm

from structllm.kernels import cpu_ext
from structllm.model.mamba2 import Mamba2
from structllm.model.recurrent import RecurrentBatch

SHAPES = {"granite4": (32, 64, 1, 128, 256), "nemotron_h": (32, 64, 8, 128, 128)}


def layer(heads: int, p: int, groups: int, n: int, chunk: int) -> Mamba2:
    m = Mamba2(1024, heads, p, groups, n, 4, chunk, 1e-5)
    with torch.no_grad():
        m.dt_bias.normal_()
        m.A_log.uniform_(0.5, 8).log_()
        m.D.normal_()
    return m


def step(lengths: list[int], native: object) -> RecurrentBatch:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    k = len(lengths)
    slots = list(range(k))
    return RecurrentBatch(
        starts,
        slots,
        torch.tensor(slots),
        [True] * k,
        torch.ones(k, dtype=torch.bool),
        0,
        native,
    )


def measure(m: Mamba2, lengths: list[int], nat: object, reps: int) -> tuple[float, float]:
    """(chunked ms, native ms) of thread CPU for one step of ``lengths``' fresh
    sequences, the two interleaved, medians of ``reps``."""
    t = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    xbc = torch.randn(t, m.conv_dim, generator=gen)
    dt = torch.randn(t, m.num_heads, generator=gen)
    states = torch.zeros(len(lengths), *m.state_shapes()[1])
    rb = step(lengths, None)
    rbn = dataclasses.replace(rb, native=nat)
    ref: list[float] = []
    new: list[float] = []
    with torch.no_grad():
        m._native_scan(xbc, dt, states, rbn)  # warm
        for _ in range(reps):
            for out, run, arm in ((ref, m._torch_scan, rb), (new, m._native_scan, rbn)):
                c = time.thread_time()
                run(xbc, dt, states, arm)
                out.append((time.thread_time() - c) * 1e3)
    return statistics.median(ref), statistics.median(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", default="32x16,256,2048")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    nat = cpu_ext.load_recurrent()
    if nat is None:
        raise SystemExit("no native recurrent kernels here")
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"isa {cpu_ext.best_isa()}, load {load}, one kernel thread, thread CPU")
    print(f"{'shape':<11} {'rows':>8} {'chunked ms':>11} {'native ms':>10} {'speedup':>8}")
    for name, shape in SHAPES.items():
        m = layer(*shape)
        for spec in args.lengths.split(","):
            n, _, k = spec.partition("x")
            ref, new = measure(m, [int(n)] * int(k or 1), nat, args.reps)
            print(f"{name:<11} {spec:>8} {ref:>11.2f} {new:>10.2f} {ref / new:>7.2f}x")


if __name__ == "__main__":
    main()
