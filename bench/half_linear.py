"""Float16 matmul on the CPU: quant_linear.cpp's float16 kernel (``packed.HalfMatrix``,
batch-invariant, what a float16/bfloat16 checkpoint's experts run) against fbgemm's
packed float16 (``packed.HalfWeight``, what the dense float16 layers run), on the
default model's matmul shapes ``[N, K]`` at ``--rows`` activation rows.

Each arm runs a block of ``--calls`` calls, then the other arm (a block at a time: one
arm's pool or OpenMP threads spinning after a call would otherwise delay the other's
next call, which a step of either path alone does not see), for ``--rounds`` rounds;
per arm, the median of its blocks' median call time. ``--cold`` cycles each arm
through copies of its weights (at least 256 MB), as a decode step streams its
matrices from memory. Prints a table (microseconds per call, fbgemm / ours) with the
load average, and whether each arm's rows are bit-identical at 1 and ``rows`` rows.

    python bench/half_linear.py [--rows 1 16] [--cold]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from structllm.kernels import cpu_ext
from structllm.kernels.packed import HalfMatrix, HalfWeight, linear

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]
COLD_BYTES = 256 << 20


def block_median_us(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def cycling(x: torch.Tensor, ws: list[HalfMatrix] | list[HalfWeight]) -> Callable[[], object]:
    """A call of ``linear(x, w)`` for the next of ``ws`` each time."""
    it = itertools.cycle(ws)
    return lambda: linear(x, next(it))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args()
    module = cpu_ext.load_quant()
    assert module is not None
    print(f"# isa {module.isa()}, threads {torch.get_num_threads()}, cold {args.cold}")
    print(
        f"{'shape':>12} {'M':>3} {'ours us':>9} {'fbgemm us':>10} {'fbgemm/ours':>12}  bit-stable"
    )
    for n, k in SHAPES:
        torch.manual_seed(n + k)
        w = (torch.randn(n, k) * 0.05).half()
        copies = max(1, COLD_BYTES // (2 * n * k)) if args.cold else 1
        ours = [HalfMatrix(w.clone()) for _ in range(copies)]
        fb = [HalfWeight(w) for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k)
            stable = {
                name: torch.equal(linear(x[:1].clone(), ws[0]), linear(x, ws[0])[:1])
                for name, ws in (("ours", ours), ("fbgemm", fb))
            }
            arms = {"ours": cycling(x, list(ours)), "fbgemm": cycling(x, list(fb))}
            got: dict[str, list[float]] = {a: [] for a in arms}
            for r in range(args.rounds):
                for name in arms if r % 2 == 0 else list(arms)[::-1]:
                    got[name].append(block_median_us(arms[name], args.calls))
            a, b = (statistics.median(got[name]) for name in ("ours", "fbgemm"))
            print(
                f"{n:>6}x{k:<5} {m:>3} {a:9.1f} {b:10.1f} {b / a:11.2f}x  "
                f"ours {stable['ours']}, fbgemm {stable['fbgemm']}",
                flush=True,
            )
    print(f"# load average {Path('/proc/loadavg').read_text().split()[0]}")


if __name__ == "__main__":
    main()
