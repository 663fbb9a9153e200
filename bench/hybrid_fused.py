r"""A hybrid model's decode step on the fused CPU layer loop against the plain one, in the
same engine: thread-CPU time per decode step (one torch thread: the step's whole cost,
which a loaded machine inflates far less than wall time), the two loops interleaved
(``HybridModel.fused_layers`` toggled), median over ``--rounds`` x 12 steps.

    python bench/hybrid_fused.py FILE.gguf [...] [--rows 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_breakdown, beside this file

STEPS = 12  # decode steps timed per arm and round


def measure(path: str, rows: int, rounds: int) -> dict[str, float]:
    import step_breakdown as sb

    from structllm.config import EngineConfig, SpeculativeConfig
    from structllm.engine.core import EngineCore

    core = EngineCore(
        EngineConfig(
            model=path,
            max_num_seqs=rows,
            num_threads=1,
            speculative_config=SpeculativeConfig(method="none"),
        )
    )
    model = core.runner.model
    if model.cpu_ops is None:
        sys.exit(f"{path}: the fused CPU ops are not in use (an exact format, or not built)")
    times: dict[bool, list[int]] = {True: [], False: []}
    for r in range(rounds):
        for fused in (False, True):
            model.fused_layers = fused
            ids = [f"r{r}-{fused}-{i}" for i in range(rows)]
            for i, rid in enumerate(ids):
                sb.add_request(core, rid, STEPS + rows + 8, r * 100 + i)
            sb.prefill(core)
            for _ in range(STEPS):
                t0 = time.thread_time_ns()
                core.step()
                times[fused].append(time.thread_time_ns() - t0)
            core.abort(ids)
            while core.has_work:
                core.step()
    plain, fused = (statistics.median(times[f]) / 1000 for f in (False, True))
    return {"plain_us": plain, "fused_us": fused, "ratio": plain / fused}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("files", nargs="+", help="GGUF files of hybrid models")
    ap.add_argument("--rows", type=int, default=16, help="requests decoding together")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"# thread-CPU us per decode step, {args.rows} rows, one thread, load {load}")
    for f in args.files:
        r = measure(f, args.rows, args.rounds)
        print(
            f"{Path(f).name}: plain {r['plain_us']:.0f}, fused {r['fused_us']:.0f}, "
            f"plain / fused {r['ratio']:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
