r"""A hybrid model's decode step on the native decode loop (``model/decode_plan.py``,
``cpu_decode.cpp``'s hybrid section) against the Python fused layer loop, in the same
engine: thread-CPU time per decode step (one torch thread: the step's whole cost, which
a loaded machine inflates far less than wall time), the two loops interleaved
(``model.native_decode`` toggled), median over ``--rounds`` x 12 steps. The families'
bench-shape files (``bench/models.py``'s ``BENCH_SHAPES``) in Q8_0 as llama.cpp's
converter writes it.

    python bench/hybrid_decode.py [--families lfm2,qwen3_5] [--rows 1,16] [--rounds 3]
        [--torch-scan]

``--torch-scan``: the Python loop's Mamba-2 decode rows through torch's ops
(``Mamba2.native_scan`` False: that loop as it was before cpu_recurrent.cpp's
``ssm_decode``), for Granite 4's and Nemotron-H's before/after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_breakdown, models
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support

STEPS = 12  # decode steps timed per arm and round


def bench_file(family: str) -> Path:
    from models import BENCH_SHAPES

    from structllm.model.files import find_model_files
    from tests.support import llamacpp
    from tests.support.models import CONVERTER_ARGS, gguf_source_dir

    source = gguf_source_dir(family, find_model_files(None), **BENCH_SHAPES[family])
    return llamacpp.convert_hf(source, "q8_0", *CONVERTER_ARGS.get(family, ()))


def measure(path: Path, rows: int, rounds: int, torch_scan: bool = False) -> dict[str, float]:
    import step_breakdown as sb

    from structllm.config import EngineConfig, SpeculativeConfig
    from structllm.engine.core import EngineCore
    from structllm.model.mamba2 import Mamba2

    core = EngineCore(
        EngineConfig(
            model=str(path),
            max_num_seqs=rows,
            num_threads=1,
            speculative_config=SpeculativeConfig(method="none"),
        )
    )
    model = core.runner.model
    if model.decode_path != "native":
        sys.exit(f"{path.name}: decode steps take {model.decode_why}")
    times: dict[bool, list[int]] = {True: [], False: []}
    for r in range(rounds):
        for native in (False, True):
            model.native_decode = native
            Mamba2.native_scan = native or not torch_scan
            ids = [f"r{r}-{native}-{i}" for i in range(rows)]
            for i, rid in enumerate(ids):
                sb.add_request(core, rid, STEPS + rows + 8, r * 100 + i)
            sb.prefill(core)
            for _ in range(STEPS):
                t0 = time.thread_time_ns()
                core.step()
                times[native].append(time.thread_time_ns() - t0)
            core.abort(ids)
            while core.has_work:
                core.step()
    python, native = (statistics.median(times[n]) / 1000 for n in (False, True))
    return {"python_us": python, "native_us": native, "ratio": python / native}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--families", default="lfm2,qwen3_5")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-scan", action="store_true", help="see the docstring")
    args = ap.parse_args()
    from structllm.kernels import cpu_ext

    results = []
    for family in args.families.split(","):
        path = bench_file(family)
        for rows in (int(r) for r in args.rows.split(",")):
            load = Path("/proc/loadavg").read_text().split()[:3]
            res = measure(path, rows, args.rounds, args.torch_scan)
            py, nat = res["python_us"], res["native_us"]
            arm = "python (torch scan)" if args.torch_scan else "python"
            print(
                f"{family:<8} {cpu_ext.best_isa()} rows {rows:>2}: {arm} {py:8.0f} us,"
                f" native {nat:8.0f} us, {res['ratio']:.3f}x (load {' '.join(load)})"
            )
            results.append({"family": family, "rows": rows, "load": load, **res})
    out = {"bench": "hybrid_decode", "isa": cpu_ext.best_isa(), "torch_scan": args.torch_scan}
    print(json.dumps({**out, "results": results}))


if __name__ == "__main__":
    main()
