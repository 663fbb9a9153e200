"""Decode-size cost of each GGUF block type against Q4_1, per weight byte.

One activation row (``--rows`` M: more; 2-8 the same row kernel, from 9 the blocked
GEMM, the concurrency-16 case; on AVX-512 VNNI Q4_0/Q4_1/Q8_0 take the row kernel in
passes of 8 up to 16 rows) through the int16 path (``quant_linear.cpp``, what
q/k/v, the attention output and the head run at decode), one thread, one matrix per
block type (``--n`` x ``--k``; K a multiple of 256 for the k-quants), random blocks as
``bench/quant_linear.py`` makes them. The types are timed in interleaved rounds and
each keeps its fastest round (the minimum is the figure a neighbour's load touches
least on a shared machine); printed: microseconds per call, time against Q4_1's, and
time per weight byte (``packed.BLOCK_BYTES``) against Q4_1's, the issue's measure.

    python bench/quant_row.py                # this CPU's widest ISA
    STRUCTLLM_CPU_ISA=avx2 python bench/quant_row.py
    python bench/quant_row.py --rows 16      # 16 rows (the blocked GEMM, or row passes)
    python bench/quant_row.py --mode int8    # the MLP's path (4- and 5-bit types)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quant_linear import block_weight

from structllm.kernels import cpu_ext
from structllm.kernels.packed import BLOCK_BYTES, BLOCK_TYPES, INT8, INT16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--k", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=20, help="calls per timing")
    ap.add_argument("--rows", type=int, default=1, help="activation rows M (9+: the blocked GEMM)")
    ap.add_argument(
        "--mode", choices=["int16", "int8"], default="int16", help="int8: the MLP's path"
    )
    ap.add_argument("--types", nargs="+", default=list(BLOCK_TYPES), choices=list(BLOCK_TYPES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    module = cpu_ext.load_quant()
    if module is None:
        print("the block kernels are unavailable on this CPU", file=sys.stderr)
        return 2
    types = ["Q4_1", *[t for t in args.types if t != "Q4_1"]]
    ws = {t: block_weight(args.n, args.k, t, seed=0) for t in types}
    x = torch.randn(args.rows, args.k)
    mode = INT8 if args.mode == "int8" else INT16
    best = {t: float("inf") for t in types}
    for _ in range(args.rounds):
        for t in types:
            w = ws[t]
            t0 = time.perf_counter()
            for _ in range(args.calls):
                module.linear(x, w.raw, w.code, mode)
            best[t] = min(best[t], (time.perf_counter() - t0) / args.calls * 1e6)
    base = best["Q4_1"]
    print(
        f"{module.isa()}, 1 thread, {args.rows} rows, {args.mode} path, {args.n}x{args.k}",
        file=sys.stderr,
    )
    print(f"{'type':>7}{'us':>9}{'time':>8}{'per byte':>10}", file=sys.stderr)
    rows = []
    for t in types:
        per_byte = best[t] / BLOCK_BYTES[t] / (base / BLOCK_BYTES["Q4_1"])
        print(f"{t:>7}{best[t]:>9.1f}{best[t] / base:>7.2f}x{per_byte:>9.2f}x", file=sys.stderr)
        rows.append({"type": t, "us": round(best[t], 1), "vs_q4_1": round(best[t] / base, 3),
                     "per_byte_vs_q4_1": round(per_byte, 3)})  # fmt: skip
    print(
        json.dumps(
            {
                "bench": "quant_row",
                "isa": module.isa(),
                "rows": args.rows,
                "mode": args.mode,
                "results": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
