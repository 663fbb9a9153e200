"""Q8_0 matmuls at prompt sizes: the int8 path's blocked GEMM (8-bit activations,
vpdpbusd / vpmaddubsw, what ``--cpu-activations int8`` runs in an encoder's matmuls)
against the int16 path (``auto``'s, 16-bit activations) and the float path, on BERT-base's
shapes (fused q/k/v [2304, 768], o [768, 768], up [3072, 768], down [768, 3072]).

One kernel thread; thread CPU time (``time.thread_time``) per call, the median of
``--reps`` interleaved rounds, so that a loaded machine's neighbours hit every path
alike. Prints a table (ms per call, and int16 / int8) and one JSON line.

    python bench/q8_0_prompt.py [--rows 16 64 380] [--reps 5]

(Before this GEMM, Q8_0's int8 mode ran the row kernel at every size: 2.6x the int8
GEMM's time at 380 rows, see docs/benchmarks.md.)
    STRUCTLLM_CPU_ISA=avx2 python bench/q8_0_prompt.py     # the AVX2 build
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's structllm

from structllm.kernels import cpu_ext
from structllm.kernels.packed import FLOAT, INT8, INT16

SHAPES = {"qkv": (2304, 768), "o": (768, 768), "up": (3072, 768), "down": (768, 3072)}


def q8_0_blocks(n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random Q8_0 blocks ``[n, k/32 * 34]``: quants in [-127, 127], scales ~1/127."""
    raw = np.zeros((n, k // 32, 34), dtype=np.uint8)
    raw[..., 0:2] = np.array([1 / 127], dtype=np.float16).view(np.uint8)
    raw[..., 2:] = rng.integers(-127, 128, (n, k // 32, 32), dtype=np.int8).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def cpu_ms(fn: object, min_s: float = 0.1) -> float:
    calls, start = 0, time.thread_time()
    while True:
        fn()  # type: ignore[operator]
        calls += 1
        spent = time.thread_time() - start
        if spent >= min_s:
            return 1000 * spent / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 380])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    module = cpu_ext.load_quant()
    rng = np.random.default_rng(0)
    paths = {"float": FLOAT, "int16": INT16, "int8": INT8}
    rows_out = []
    print(f"isa {module.isa()}, one thread, thread CPU ms per call (median of {args.reps})")
    print(f"{'shape':>6} {'M':>5}" + "".join(f"{p:>9}" for p in paths) + "  int16/int8")
    for m in args.rows:
        for name, (n, k) in SHAPES.items():
            w = q8_0_blocks(n, k, rng)
            x = torch.randn(m, k)
            times: dict[str, list[float]] = {p: [] for p in paths}
            for _ in range(args.reps):
                for p, mode in paths.items():
                    times[p].append(
                        cpu_ms(lambda x=x, w=w, mode=mode: module.linear(x, w, 2, mode))
                    )
            med = {p: statistics.median(t) for p, t in times.items()}
            print(
                f"{name:>6} {m:>5}"
                + "".join(f"{med[p]:9.2f}" for p in paths)
                + f"  {med['int16'] / med['int8']:9.2f}x"
            )
            rows_out.append({"shape": name, "rows": m, **med})
    print(json.dumps({"isa": module.isa(), "cases": rows_out}))


if __name__ == "__main__":
    main()
