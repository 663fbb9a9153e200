r"""A hybrid model's prompt and 16-stream throughput with the recurrent layers' native
kernels (``cpu_recurrent.cpp``: prefill chunks, decode rows, Gated DeltaNet's inputs and
gated norm) against torch's ops, in the same engine, interleaved (the kernels taken away
as if they had not built: ``HybridModel._recurrent = False``). Best of ``--rounds``, and
the least process CPU time of each.

    python bench/hybrid_prefill.py FILE.gguf [--prompt-len 2048] [--budget 512] [--rounds 2]
        [--ssm-chunked]

The torch arm is main's prefill before the native prefill kernels; its decode rows also
lose their native kernels, so its 16-stream figure is below main's. With --ssm-chunked
the second arm keeps every native kernel but Mamba-2's prefill scan (``ssm_prefill``),
whose prompt rows run torch's chunked form as before it (``Mamba2.native_prefill``).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


def main() -> None:
    from structllm import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ssm-chunked", action="store_true", help="the second arm: see above")
    args = ap.parse_args()
    llm = LLM(
        args.model,
        kv_cache_memory=512 << 20,
        max_num_seqs=32,
        max_num_batched_tokens=args.budget,
        speculative_config={"method": "none"},
    )
    model: Any = llm.engine.runner.model  # type: ignore[union-attr]
    llm.generate(prompts(2, 32, 0), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    native = model._recurrent
    if not native:
        raise SystemExit("no native recurrent kernels here (or not a hybrid model)")
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    from structllm.model.mamba2 import Mamba2

    other = "chunked" if args.ssm_chunked else "torch"
    best: dict[str, list[float]] = {"native": [0.0, 0.0], other: [0.0, 0.0]}
    # the process's CPU seconds (every thread, spinning workers too): steadier than the
    # wall clock on a loaded machine
    cpu: dict[str, list[float]] = {"native": [1e9, 1e9], other: [1e9, 1e9]}
    for r in range(args.rounds):
        for arm in ("native", other):
            model._recurrent = False if arm == "torch" else native
            Mamba2.native_prefill = arm != "chunked"
            llm.engine.kv.reset_prefix_cache()
            t, c = time.perf_counter(), time.process_time()
            llm.generate(prompts(1, args.prompt_len, 100 + r), one)
            prompt = args.prompt_len / (time.perf_counter() - t)
            prompt_cpu = time.process_time() - c
            llm.engine.kv.reset_prefix_cache()
            t, c = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts(16, 32, 7), sp)
            batch = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
            batch_cpu = time.process_time() - c
            best[arm] = [max(best[arm][0], prompt), max(best[arm][1], batch)]
            cpu[arm] = [min(cpu[arm][0], prompt_cpu), min(cpu[arm][1], batch_cpu)]
            print(
                f"round {r} {arm}: prompt {prompt:.1f} tok/s ({prompt_cpu:.2f} CPU s), "
                f"16 streams {batch:.1f} tok/s ({batch_cpu:.2f} CPU s)"
            )
    (np, nb), (tp, tb) = best["native"], best[other]
    print(
        f"best: prompt {np:.1f} / {tp:.1f} tok/s ({np / tp:.2f}x), "
        f"16 streams {nb:.1f} / {tb:.1f} ({nb / tb:.2f}x)"
    )
    (nc, nbc), (tc, tbc) = cpu["native"], cpu[other]
    print(
        f"least CPU: prompt {nc:.2f} / {tc:.2f} s ({tc / nc:.2f}x), "
        f"16 streams {nbc:.2f} / {tbc:.2f} s ({tbc / nbc:.2f}x)"
    )


if __name__ == "__main__":
    main()
