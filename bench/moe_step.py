r"""A mixture-of-experts decode step: the experts in one native call per layer
(``cpu_moe.cpp``) against the per-expert Python loop it replaced, in one process,
alternating step by step (A/B/A/B), at one and at ``--batch`` running sequences.

Prints the median step time of each arm, their ratio and the load average, and the
weight bytes of the dense matrices, the head and one expert per layer (a batch-1 step
reads the dense ones, the head and ``top_k`` experts per layer).

    python bench/moe_step.py MODEL.gguf [--batch 16] [--steps 24]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any


def arm_steps(llm: Any, batch: int, steps: int, input_len: int) -> dict[str, list[float]]:
    from structllm import SamplingParams
    from structllm.protocol import AddRequest

    moes = [layer.moe for layer in llm.engine.runner.model.layers if layer.moe is not None]
    native = [m.native_experts() for m in moes]
    assert all(n is not None for n in native), "the experts are not block weights"
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    llm.engine.kv.reset_prefix_cache()
    for i in range(batch):
        ids = [rng.randrange(100, 49000) for _ in range(input_len)]
        llm.engine.add_request(AddRequest(f"r{batch}-{i}", ids, sp))
    for _ in range(batch * input_len):  # until every prompt is in (chunked prefill)
        if not llm.engine.scheduler.waiting:
            break
        llm.engine.step()
    for _ in range(2):  # the last prefill chunks: every sequence is decoding after these
        llm.engine.step()
    times: dict[str, list[float]] = {"native": [], "loop": []}
    for s in range(steps):
        arm = "native" if s % 2 == 0 else "loop"
        for m, n in zip(moes, native, strict=True):
            m.native = n if arm == "native" else False
        t = time.perf_counter()
        llm.engine.step()
        times[arm].append(time.perf_counter() - t)
    for m, n in zip(moes, native, strict=True):
        m.native = n
    while llm.engine.has_work:
        llm.engine.step()
    return times


def main() -> None:
    from structllm import LLM
    from structllm.kernels.packed import weight_bytes

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=32)
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_memory=256 << 20, max_num_seqs=32)
    model = llm.engine.runner.model
    cfg = model.cfg
    expert_bytes = dense = 0
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            w = getattr(layer, name, None)
            if w is not None:
                dense += weight_bytes(w)
        if layer.moe is not None:
            e = layer.moe.experts[0]
            expert_bytes += weight_bytes(e.gate_up_proj) + weight_bytes(e.down_proj)
    head = getattr(model, "lm_head", None)
    head_bytes = weight_bytes(head) if head is not None else 0
    k = cfg.num_experts_per_tok
    print(
        f"# {Path(args.model).name}: {cfg.num_layers} layers, {cfg.num_experts} experts, top {k}; "
        f"dense matrices {dense / 2**20:.1f} MiB, head {head_bytes / 2**20:.1f} MiB, "
        f"one expert in every layer {expert_bytes / 2**20:.1f} MiB"
    )
    for batch in (1, args.batch):
        times = arm_steps(llm, batch, args.steps, args.input_len)
        nat, loop = (statistics.median(times[a]) * 1e3 for a in ("native", "loop"))
        load = Path("/proc/loadavg").read_text().split()[0]
        print(
            f"batch {batch:>3}: native {nat:7.2f} ms/step, loop {loop:7.2f} ms/step, "
            f"loop/native {loop / nat:.2f}x (median of {len(times['native'])} steps each, "
            f"alternating; load {load})",
            flush=True,
        )
    llm.close()


if __name__ == "__main__":
    main()
