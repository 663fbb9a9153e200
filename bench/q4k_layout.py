"""A k-quant held as the file's super-blocks (``--type`` Q4_K, Q5_K or Q6_K: 144, 176 or
210 bytes per 256 weights, ``cpu_kquants.h``) against the blocks of 32 it was repacked
into before (22, 26 or 28 bytes), per matmul, same run.

The baseline is ``quant_linear.cpp`` (and its headers) as of ``--base`` (a git revision
from before the native layout: default ``a575c58`` for Q4_K, ``945b17a`` for Q5_K and
Q6_K), built as its own module beside this tree's: this tree's kernels no longer read the
repacked blocks (their branches are gone), so the old layout exists only in git history.
Both run the same random super-blocks (the baseline on ``packed.repack``'s blocks of them)
on the same activations, at Llama 3.2 1B's matmul shapes (fused q/k/v, o, fused
gate/up, down), for ``--rows`` activation rows on the int8 (the MLP's; not Q6_K, whose
int8 mode is its int16 path) and int16 paths. Weights cold by default: each variant
cycles through copies of its weights (at least 256 MB), as a decode step streams them.
Timings interleaved (new, old, new, ...) for ``--reps`` rounds, median per call
(``--cpu-time``: by this thread's CPU time rather than the wall clock). Also checks that
both give the same outputs bit for bit. Prints a table (microseconds per call, weight
bytes, old / new) and a JSON line.

    python bench/q4k_layout.py                          # this CPU's widest ISA
    STRUCTLLM_CPU_ISA=avx2 python bench/q4k_layout.py   # the AVX2 builds
    python bench/q4k_layout.py --type Q6_K --rows 1 16
    python bench/q4k_layout.py --type Q6_K --rows 2 4 8 --hot --threads 1 --cpu-time
        # the row kernels alone: one thread, the same weights each call, CPU time
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from structllm.kernels import cpu_ext, packed
from structllm.paths import cache_root

SHAPES = [  # Llama 3.2 1B, as the model runs them
    ("qkv 3072x2048", 3072, 2048),
    ("o 2048x2048", 2048, 2048),
    ("gate_up 16384x2048", 16384, 2048),
    ("down 2048x8192", 2048, 8192),
]
SOURCES = ("quant_linear.cpp", "cpu_pool.h", "cpu_simd.h", "cpu_tables.h")
# headers a later baseline includes (quant_linear.cpp's parts, from this tree's split on)
OPTIONAL = (
    "cpu_kquants.h",
    "cpu_iquants.h",
    "cpu_blocks.h",
    "cpu_rows.h",
    "cpu_gemm.h",
    "cpu_half.h",
)
BASES = {"Q4_K": "a575c58", "Q5_K": "945b17a", "Q6_K": "945b17a"}


def baseline(rev: str, isa: str) -> Any:
    """``quant_linear.cpp`` at ``rev``, built for ``isa`` (cached like any kernel)."""
    root = Path(__file__).resolve().parents[1]
    d = cache_root() / "bench" / f"quant_{rev}"
    d.mkdir(parents=True, exist_ok=True)
    for name in (*SOURCES, *OPTIONAL):
        got = subprocess.run(
            ["git", "-C", str(root), "show", f"{rev}:structllm/kernels/{name}"],
            check=name in SOURCES,
            capture_output=True,
        )
        if got.returncode == 0:
            (d / name).write_bytes(got.stdout)
    flags = [*cpu_ext.QUANT_FLAGS, cpu_ext._ISA_MARCH[isa]]
    module = cpu_ext.build(
        f"structllm_quant_base_{isa}",
        d / SOURCES[0],
        flags,
        f"{rev}'s kernels",
    )  # (the key hashes quant_linear.cpp alone: one directory per revision)
    if module is None:
        raise RuntimeError(f"could not build quant_linear.cpp at {rev}")
    return cpu_ext._share_pool(module)


def super_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random super-blocks ``[n, k / 256 * FILE_BYTES]`` with sane float16 scales."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, packed.FILE_BYTES[type_name]), dtype=np.uint8)
    if type_name == "Q6_K":
        raw[..., 208:210] = np.array([1e-4], dtype=np.float16).view(np.uint8)
    else:
        raw[..., 0:2] = np.array([1e-3], dtype=np.float16).view(np.uint8)
        raw[..., 2:4] = np.array([5e-4], dtype=np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def copies(t: torch.Tensor, cold: bool) -> list[torch.Tensor]:
    count = max(1, (256 << 20) // t.numel()) if cold else 1
    return [t.clone() for _ in range(count)]


def caller(module: Any, ws: list[torch.Tensor], x: torch.Tensor, code: int, mode: int) -> Any:
    """A call of ``module``'s matmul, each on the next copy of the weights."""
    it = iter(range(1 << 62))

    def call() -> None:
        module.linear(x, ws[next(it) % len(ws)], code, mode)

    return call


def time_us(fn: Any, min_s: float, clock: Any = time.perf_counter) -> float:
    """Microseconds per call of ``fn`` by ``clock`` (wall, or this thread's CPU time)."""
    fn()
    n, start = 0, clock()
    while (elapsed := clock() - start) < min_s or n < 3:
        fn()
        n += 1
    return elapsed / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--type", default="Q4_K", choices=sorted(BASES))
    ap.add_argument("--base", default=None, help="git revision of the repacked layout")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-s", type=float, default=0.05)
    ap.add_argument("--hot", action="store_true", help="the same weights every call")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by this thread's CPU time (with --threads 1: the kernel's own work)",
    )
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    isa = cpu_ext.best_isa()
    if isa is None:
        print("no AVX2 kernels on this CPU", file=sys.stderr)
        return 1
    code = packed.BLOCK_TYPES[a.type]
    clock = time.thread_time if a.cpu_time else time.perf_counter
    new, old = cpu_ext.load_quant(isa), baseline(a.base or BASES[a.type], isa)
    print(
        f"{a.type}: isa {new.isa()}, threads {torch.get_num_threads()},"
        f" load {os.getloadavg()[0]:.1f}"
    )
    paths = [(packed.INT16, "int16")]
    if a.type in packed.INT8_TYPES:
        paths.insert(0, (packed.INT8, "int8"))
    rows_out = []
    for name, n, k in SHAPES:
        raw = super_blocks(a.type, n, k, seed=n + k)
        native = torch.from_numpy(raw)
        repacked = torch.from_numpy(packed.repack(raw.reshape(-1), a.type).reshape(n, -1))
        ws_new, ws_old = copies(native, not a.hot), copies(repacked, not a.hot)
        for m in a.rows:
            x = torch.randn(m, k)
            for mode, path in paths:
                same = torch.equal(
                    new.linear(x, native, code, mode), old.linear(x, repacked, code, mode)
                )
                variants = {"new": (new, ws_new), "old": (old, ws_old)}
                times: dict[str, list[float]] = {"new": [], "old": []}
                for _ in range(a.reps):
                    for which, (mod, ws) in variants.items():
                        times[which].append(time_us(caller(mod, ws, x, code, mode), a.min_s, clock))
                t_new, t_old = statistics.median(times["new"]), statistics.median(times["old"])
                row = {
                    "shape": name,
                    "rows": m,
                    "path": path,
                    "new_us": round(t_new, 1),
                    "old_us": round(t_old, 1),
                    "old_over_new": round(t_old / t_new, 3),
                    "new_mb": round(native.numel() / 1e6, 2),
                    "old_mb": round(repacked.numel() / 1e6, 2),
                    "bitwise_equal": same,
                }
                rows_out.append(row)
                print(
                    f"{name:20s} M={m:<4d} {path:5s} new {t_new:9.1f} us  old {t_old:9.1f} us"
                    f"  old/new {t_old / t_new:5.2f}  ({row['new_mb']} vs {row['old_mb']} MB)"
                    f"  equal {same}",
                    flush=True,
                )
    print(json.dumps({"type": a.type, "isa": new.isa(), "results": rows_out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
