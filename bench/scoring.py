"""The cost of scoring and of ``logit_bias``, offline, same prompts, same run.

    python bench/scoring.py            # 32 prompts x 256 tokens; a batch of 16 x 128 tokens
    python bench/scoring.py --quick    # smaller, for a fast look

Scoring: prompt tokens per second of a prefill-only run (``max_tokens=0``) of
``--num-prompts`` random prompts, without and with ``prompt_logprobs=--top`` (which
computes the logits, log-softmax and top-N of every prompt position). ``logit_bias``:
decode tokens per second of a batch of ``--batch`` sequences (short prompts, seeded
sampling at temperature 1, EOS ignored) without and with a bias of ``--bias-size``
entries on every sequence. Each figure is the best of ``--reps`` runs; the two sides
of a comparison alternate, so drift in the machine's speed hits both alike. Prints a
table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any


def make_prompts(vocab_size: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Fixed-seed random ids: no two prompts share a prefix (the cache is reset anyway)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size - 100) for _ in range(length)] for _ in range(n)]


def timed(llm: Any, prompts: list[list[int]], sp: Any) -> tuple[float, list[Any]]:
    llm.engine.kv.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    return time.perf_counter() - t, outs


def best_of(
    llm: Any, reps: int, prompts: list[list[int]], a: Any, b: Any
) -> tuple[float, float, list[Any]]:
    """Best seconds of ``a`` and of ``b`` over ``reps`` alternating runs, and ``b``'s outputs."""
    ta, tb, outs = float("inf"), float("inf"), []
    for _ in range(reps):
        ta = min(ta, timed(llm, prompts, a)[0])
        dt, outs = timed(llm, prompts, b)
        tb = min(tb, dt)
    return ta, tb, outs


def bench_scoring(llm: Any, args: argparse.Namespace) -> dict[str, float]:
    from structllm import SamplingParams

    prompts = make_prompts(llm.engine.vocab_size, args.num_prompts, args.input_len)
    plain = SamplingParams(max_tokens=0)
    scored = SamplingParams(max_tokens=0, prompt_logprobs=args.top)
    llm.generate(prompts[:2], scored)  # warm up
    t_plain, t_scored, outs = best_of(llm, args.reps, prompts, plain, scored)
    assert all(
        o.prompt_logprobs is not None and len(o.prompt_logprobs) == args.input_len for o in outs
    )
    n = args.num_prompts * args.input_len
    return {
        "prompt_tokens": n,
        "plain_prompt_tok_s": n / t_plain,
        "scored_prompt_tok_s": n / t_scored,
        "scoring_slowdown": t_scored / t_plain,
    }


def bench_bias(llm: Any, args: argparse.Namespace) -> dict[str, float]:
    from structllm import SamplingParams

    vocab = llm.engine.vocab_size
    prompts = make_prompts(vocab, args.batch, 16, seed=1)
    rng = random.Random(2)
    bias = {rng.randrange(vocab): rng.uniform(-5.0, 5.0) for _ in range(args.bias_size)}
    kw: dict[str, Any] = dict(temperature=1.0, seed=0, max_tokens=args.output_len, ignore_eos=True)
    plain, biased = SamplingParams(**kw), SamplingParams(**kw, logit_bias=bias)
    llm.generate(prompts[:2], biased)  # warm up
    t_plain, t_biased, outs = best_of(llm, args.reps, prompts, plain, biased)
    n = sum(len(o.token_ids) for o in outs)
    return {
        "output_tokens": n,
        "plain_decode_tok_s": n / t_plain,
        "biased_decode_tok_s": n / t_biased,
        "bias_slowdown": t_biased / t_plain,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--top", type=int, default=5, help="prompt_logprobs=N")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--bias-size", type=int, default=10, help="logit_bias entries per sequence")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--quick", action="store_true", help="8 prompts x 128 tokens; 32 new tokens; 2 reps"
    )
    args = p.parse_args()
    if args.quick:
        args.num_prompts, args.input_len, args.output_len, args.reps = 8, 128, 32, 2

    from structllm import LLM

    with LLM(args.model, device=args.device, kv_cache_memory=args.kv_cache_memory) as llm:
        device = str(llm.engine.device)
        s = bench_scoring(llm, args)
        b = bench_bias(llm, args)
    print(f"device {device}")
    print(
        f"scoring: {args.num_prompts} prompts x {args.input_len} tokens, prefill only, "
        f"prompt_logprobs={args.top}"
    )
    print(f"  without prompt logprobs  {s['plain_prompt_tok_s']:10.0f} prompt tok/s")
    print(
        f"  with prompt logprobs     {s['scored_prompt_tok_s']:10.0f} prompt tok/s  "
        f"(x{s['scoring_slowdown']:.2f} time)"
    )
    print(
        f"logit_bias: batch {args.batch} x {args.output_len} tokens, "
        f"{args.bias_size} biased ids each"
    )
    print(f"  without logit_bias       {b['plain_decode_tok_s']:10.0f} tok/s")
    print(
        f"  with logit_bias          {b['biased_decode_tok_s']:10.0f} tok/s  "
        f"(x{b['bias_slowdown']:.2f} time)"
    )
    print(json.dumps({"device": device, **s, **b}))


if __name__ == "__main__":
    main()
