r"""Time to first token of a repeated prompt on a hybrid model, with and without the
prefix-cache hit (its recurrent state resumed from the one saved at the prompt's last
full block, ``engine.state_cache``).

The LFM2 family at ``models.BENCH_SHAPES`` (hidden 1024, 8 layers), its default format,
one engine per arm: ``off`` (prefix caching off: every request computes the whole
prompt) and ``on`` (the first request computes it and saves the state, each repeat
resumes it). A request is the prompt with ``max_tokens`` 1, so its time is the time to
its first token; the arms run interleaved, ``--rounds`` times, median reported.

    python bench/hybrid_prefix.py [--family lfm2] [--prompt-len 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support, bench

from bench.models import BENCH_SHAPES, prompts
from structllm import LLM, SamplingParams
from structllm.model.files import find_model_files
from tests.support.models import tiny_family_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="lfm2")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    path = tiny_family_dir(args.family, find_model_files(None), **BENCH_SHAPES[args.family])
    prompt = prompts(1, args.prompt_len)[0]
    one = SamplingParams(temperature=0, max_tokens=1)
    # (the bench shape's config says 512 positions; random weights read any)
    room = {"max_position_embeddings": max(4096, 2 * args.prompt_len)}
    arms = {
        "off": LLM(str(path), enable_prefix_caching=False, hf_overrides=room),
        "on": LLM(str(path), hf_overrides=room),
    }
    want: dict[str, list[int]] = {}
    miss: dict[str, float] = {}
    for name, llm in arms.items():  # the first request: a miss for both
        start = time.perf_counter()
        want[name] = llm.generate([prompt], one)[0].token_ids
        miss[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in arms}
    cached = 0
    for _ in range(args.rounds):
        for name, llm in arms.items():
            start = time.perf_counter()
            out = llm.generate([prompt], one)[0]
            times[name].append(time.perf_counter() - start)
            assert out.token_ids == want[name], "a hit changed the first token"
            if name == "on":
                cached = out.num_cached_tokens
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(
        f"{args.family} at its bench shape, {args.prompt_len}-token prompt, load {' '.join(load)}"
    )
    print(f"  TTFT without the hit {1000 * off:8.1f} ms (median of {args.rounds})")
    print(f"  TTFT with the hit    {1000 * on:8.1f} ms ({cached} tokens resumed), {off / on:.1f}x")
    print(
        f"  first request (a miss): caching on {1000 * miss['on']:.1f} ms, "
        f"off {1000 * miss['off']:.1f} ms"
    )
    print(
        json.dumps(
            {
                "family": args.family,
                "prompt_len": args.prompt_len,
                "ttft_off_s": off,
                "ttft_hit_s": on,
                "cached_tokens": cached,
                "load": load,
            }
        )
    )


if __name__ == "__main__":
    main()
