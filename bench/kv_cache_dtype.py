"""Decode step time with a float32 vs a float16 KV cache, same weights, one process.

Two engines of the default model (``--dtype``/``--quantization`` as given, default
auto) that differ only in ``--kv-cache-dtype``, each holding ``--batch`` sequences of
``--input-len`` prompt tokens; their decode steps are timed in alternation (one step of
each per round), so that load on a shared machine hits both alike, and the median and
minimum of each are printed with the attention share, then one JSON line.

    python bench/kv_cache_dtype.py [--batch 64] [--input-len 128] [--rounds 12]

``bench/offline_throughput.py --formats auto:auto:float32,auto:auto:float16`` runs the
whole offline workload per KV dtype instead (in separate processes, one after another).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any


def fill(llm: Any, prompts: list[list[int]], max_tokens: int) -> None:
    """Queue ``prompts`` and run steps until every prompt is prefilled."""
    from structllm.protocol import AddRequest, SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(AddRequest(f"kv-{i}", p, sp))
    while any(
        r.num_computed_tokens < r.prompt_len
        for r in [*eng.scheduler.running, *eng.scheduler.waiting]
    ):
        eng.step()
    eng.step()  # the first all-decode step (warm-up)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument(
        "--load-first",
        default="float32",
        choices=["float32", "float16"],
        help="which engine to load first (to check that load order does not decide the result)",
    )
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: all cores)")
    a = ap.parse_args()

    import torch

    import structllm.model.llama as llama
    from structllm import LLM

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from offline_throughput import make_prompts

    engines: dict[str, Any] = {}
    for kv in sorted(("float32", "float16"), key=lambda k: k != a.load_first):
        engines[kv] = LLM(
            max_num_seqs=a.batch,
            kv_cache_memory=a.kv_cache_memory,
            dtype=a.dtype,
            quantization=a.quantization,
            kv_cache_dtype=kv,
            enable_prefix_caching=False,
            speculative_config={"method": "none"},  # plain decode steps
            num_threads=a.threads,
        )
    prompts = make_prompts(engines["float32"].engine.vocab_size, a.batch, a.input_len)
    for llm in engines.values():
        fill(llm, prompts, a.rounds + 16)

    step_ms: dict[str, list[float]] = {kv: [] for kv in engines}
    attn_ms: dict[str, list[float]] = {kv: [] for kv in engines}
    real = llama.attention
    spent = 0.0

    def timed(*args: Any, **kw: Any) -> Any:
        nonlocal spent
        t = time.perf_counter()
        try:
            return real(*args, **kw)
        finally:
            spent += time.perf_counter() - t

    llama.attention = timed  # type: ignore[assignment]
    try:
        for _ in range(a.rounds):
            for kv, llm in engines.items():
                spent = 0.0
                t = time.perf_counter()
                llm.engine.step()
                step_ms[kv].append(1e3 * (time.perf_counter() - t))
                attn_ms[kv].append(1e3 * spent)
    finally:
        llama.attention = real  # type: ignore[assignment]

    res: dict[str, Any] = {
        "bench": "kv_cache_dtype",
        "batch": a.batch,
        "input_len": a.input_len,
        "threads": torch.get_num_threads(),
        "weights": engines["float32"].engine.weight_format.describe(),
    }
    print(
        f"decode steps at batch {a.batch}, ~{a.input_len} tokens of context, {res['weights']}, "
        f"{res['threads']} threads, {a.rounds} interleaved rounds",
        file=sys.stderr,
    )
    for kv in engines:
        med, low = statistics.median(step_ms[kv]), min(step_ms[kv])
        res[kv] = {
            "step_ms_median": round(med, 2),
            "step_ms_min": round(low, 2),
            "ms_per_token_median": round(med / a.batch, 3),
            "attention_ms_median": round(statistics.median(attn_ms[kv]), 2),
        }
        print(
            f"  {kv} KV: step {med:8.2f} ms median ({low:.2f} min), {med / a.batch:.3f} ms/token, "
            f"attention {res[kv]['attention_ms_median']:.2f} ms",
            file=sys.stderr,
        )
    ratio = res["float32"]["step_ms_median"] / res["float16"]["step_ms_median"]
    attn_ratio = res["float32"]["attention_ms_median"] / res["float16"]["attention_ms_median"]
    res["speedup_step"], res["speedup_attention"] = round(ratio, 3), round(attn_ratio, 3)
    print(
        f"  float16 KV: step {ratio:.2f}x, attention {attn_ratio:.2f}x the float32 cache's speed",
        file=sys.stderr,
    )
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
