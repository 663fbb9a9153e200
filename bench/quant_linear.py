"""GGUF block matmul on the CPU (``quant_linear.cpp``) against oneDNN-packed float32.

The default model's matmul shapes ``[N, K]`` (fused q/k/v, o, fused gate/up, down, and
the tied LM head), its block types (Q4_1 layers, Q8_0 head), at ``--rows`` activation
rows M (1: single-stream decode; 16-256: batch decode, prefill). For each case, in the
same process on the same random data: the block kernel's float path (weights
dequantised in registers, float32 math), its int8 path (activations quantised per
block of 32), and ``torch.ops.mkldnn._linear_pointwise`` with the float32 dequantised
weights packed by oneDNN, which is what ``--dtype float32 --quantization none`` runs.

Timings are interleaved (float, int8, oneDNN, float, ...) for ``--reps`` rounds and the
median per call is reported, so that a neighbour's load on a shared machine hits all
three alike. Prints a table (microseconds per call, and oneDNN / float) and one JSON line.

By default every call reads the same weights, which then sit in the CPU's caches. In the
engine a decode step streams ~100 MB of weights, each matrix read once: ``--cold`` cycles
each variant through copies of its weights (at least 256 MB of them), as the engine does.

    python bench/quant_linear.py                          # this CPU's widest ISA
    STRUCTLLM_CPU_ISA=avx2 python bench/quant_linear.py   # the AVX2 build

``--types Q5_0 Q4_K Q6_K ...`` runs every shape in each of those block types instead
(a k-quant's K rounded up to whole super-blocks of 256: 576 -> 768; its blocks are
random super-blocks with sane scales, held as the file's super-blocks as the loader does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from structllm.kernels import cpu_ext
from structllm.kernels.packed import BLOCK_TYPES, FILE_BYTES, SUPER, BlockWeight

# (name, N, K, block type): SmolLM2-135M, as the model runs them (q/k/v and gate/up fused)
SHAPES = [
    ("o 576x576", 576, 576, "Q4_1"),
    ("qkv 960x576", 960, 576, "Q4_1"),
    ("gate 1536x576", 1536, 576, "Q4_1"),
    ("gate_up 3072x576", 3072, 576, "Q4_1"),
    ("down 576x1536", 576, 1536, "Q4_1"),
    ("head 49152x576", 49152, 576, "Q8_0"),
]


MODES = {"float": 0, "int8": 1, "int16": 2}  # the kernel's path codes


def block_weight(n: int, k: int, type_name: str, seed: int) -> BlockWeight:
    import gguf

    rng = np.random.default_rng(seed)
    if type_name in FILE_BYTES:  # gguf cannot quantise k-quants: random super-blocks
        raw = rng.integers(0, 256, (n * k // 256, FILE_BYTES[type_name]), dtype=np.uint8)
        for at in (208,) if type_name == "Q6_K" else (0, 2):  # float16 d (and dmin)
            raw[:, at : at + 2] = (
                rng.uniform(1e-4, 1e-3, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
            )
        return BlockWeight.from_raw(raw, type_name, k)
    if type_name == "IQ4_NL":  # nor IQ4_NL: random indices under sane float16 scales
        raw = rng.integers(0, 256, (n * k // 32, 18), dtype=np.uint8)
        raw[:, 0:2] = (
            rng.uniform(1e-4, 1e-3, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
        return BlockWeight.from_raw(raw, type_name, k)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    return BlockWeight.from_raw(
        torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)), type_name, k
    )


COLD_BYTES = 256 << 20  # copies of a weight that --cold cycles through: past any L3


def copies(t: torch.Tensor, cold: bool, nbytes: int | None = None) -> list[torch.Tensor]:
    """``t`` alone, or (cold) enough clones of it to fill ``COLD_BYTES``. ``nbytes``: the
    size of a tensor that cannot tell its own (a oneDNN-packed one)."""
    if not cold:
        return [t]
    size = nbytes if nbytes is not None else t.numel() * t.element_size()
    return [t.clone() for _ in range(max(2, COLD_BYTES // size))]


def cycling(fn: Callable[[torch.Tensor], object], ts: list[torch.Tensor]) -> Callable[[], object]:
    """A call of ``fn`` on the next of ``ts`` each time."""
    state = {"i": 0}

    def call() -> object:
        state["i"] += 1
        return fn(ts[state["i"] % len(ts)])

    return call


def block_linear(module: Any, x: torch.Tensor, code: int, mode: int, raw: torch.Tensor) -> object:
    return module.linear(x, raw, code, mode)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> object:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def time_us(fn: Callable[[], object], min_s: float) -> float:
    """Microseconds per call, over at least ``min_s`` seconds of calls."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--shapes", nargs="+", default=None, help="name prefixes to run (default: all)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds per case")
    ap.add_argument("--min-s", type=float, default=0.05, help="seconds per timing")
    ap.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=list(MODES), help="kernel paths to time"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--types", nargs="+", default=None, choices=list(BLOCK_TYPES), help="block types to run"
    )
    ap.add_argument(
        "--cold", action="store_true", help="weights read from memory, not from the caches"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    module = cpu_ext.load_quant()
    if module is None:
        print("the block kernels are unavailable on this CPU", file=sys.stderr)
        return 2
    shapes = [
        s for s in SHAPES if args.shapes is None or any(s[0].startswith(p) for p in args.shapes)
    ]
    if args.types:
        shapes = [
            (name, n, -(-k // SUPER) * SUPER if t in FILE_BYTES else k, t)
            for t in args.types
            for name, n, k, _ in shapes
        ]
    results = []
    print(
        f"{module.isa()}, {torch.get_num_threads()} threads; us per call, median of {args.reps}",
        file=sys.stderr,
    )
    modes = {mode: code for mode, code in MODES.items() if mode in args.modes}
    print(
        f"{'shape':>18}{'type':>6}{'M':>5}{'oneDNN':>10}"
        + "".join(f"{mode:>10}{'speed':>7}" for mode in modes),
        file=sys.stderr,
    )
    for i, (name, n, k, t) in enumerate(shapes):
        w = block_weight(n, k, t, seed=i)
        packed = torch.ops.mkldnn._reorder_linear_weight(w.dequantize())
        raws, packs = copies(w.raw, args.cold), copies(packed, args.cold, 4 * n * k)
        for m in args.rows:
            x = torch.randn(m, k)
            onednn = partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], "")
            fns: dict[str, Callable[[], object]] = {
                mode: cycling(partial(block_linear, module, x, w.code, code), raws)
                for mode, code in modes.items()
            }
            fns["onednn"] = cycling(partial(onednn_linear, x), packs)
            ref = onednn()
            errs = {
                f"{mode}_rel_err": (
                    (module.linear(x, w.raw, w.code, code) - ref).norm() / ref.norm()
                ).item()
                for mode, code in modes.items()
            }
            times: dict[str, list[float]] = {key: [] for key in fns}
            for _ in range(args.reps):
                for key, fn in fns.items():
                    fn()  # warm
                    times[key].append(time_us(fn, args.min_s))
            med = {key: statistics.median(v) for key, v in times.items()}
            row = {"shape": name, "n": n, "k": k, "type": t, "m": m,
                   **{f"{key}_us": round(v, 1) for key, v in med.items()}, **errs}  # fmt: skip
            results.append(row)
            line = f"{name:>18}{t:>6}{m:>5}{med['onednn']:>10.1f}"
            for mode in modes:
                line += f"{med[mode]:>10.1f}{med['onednn'] / med[mode]:>6.2f}x"
            print(line, file=sys.stderr)
    print(json.dumps({"bench": "quant_linear", "isa": module.isa(), "cold": args.cold,
                      "threads": torch.get_num_threads(), "results": results}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
