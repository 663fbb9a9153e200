r"""Offline throughput and single-stream latency: structllm vs Hugging Face transformers.

Same prompts, same weights (transformers loads the same GGUF file, float32), same
machine, same run. Prints a table and one JSON line.

    python bench/offline_throughput.py             # 64 prompts x 128 tokens -> 128 tokens
    python bench/offline_throughput.py --quick     # 16 prompts, for a fast look
    python bench/offline_throughput.py --formats float32:none,auto:gguf,float16:none
    python bench/offline_throughput.py --no-hf --profile \
        --formats auto:auto:float32,auto:auto:float16

``--formats`` (``DTYPE:QUANTIZATION[:KV_CACHE_DTYPE]``, default ``float32:none,auto:auto``)
runs the structllm workloads once per weight format (and KV cache dtype, default
``auto``), each in a fresh process so that its resident memory (``VmRSS`` after loading
and ``VmHWM`` at the end) is its own; the first format is the baseline of the speed-up
column.

Workload: ``--num-prompts`` prompts of ``--input-len`` random tokens (fixed seed),
``--output-len`` new tokens each with EOS ignored. structllm gets all prompts at once
(continuous batching); transformers runs static batches of ``--hf-batch`` with
``generate()``. Single stream: one request at a time, time to first token and mean
time per output token after the first.

With ``--profile``, one decode step of the full batch is broken down into model
(attention separately), sampling and Python overhead (scheduling, batch building).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any


def make_prompts(vocab_size: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Fixed-seed random token ids (as ``vllm bench``'s random dataset): no two prompts
    share a prefix, so the prefix cache cannot flatter the figures."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size - 100) for _ in range(length)] for _ in range(n)]


def bench_structllm(llm: Any, prompts: list[list[int]], out_len: int) -> dict[str, float]:
    from structllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(
        prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )  # warm up
    llm.engine.kv.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    return {"output_tokens": n, "seconds": dt, "tokens_per_s": n / dt}


def single_stream_structllm(
    llm: Any, prompts: list[list[int]], out_len: int, reps: int
) -> dict[str, float]:
    """TTFT and TPOT by driving the engine step by step (one request at a time)."""
    from structllm.protocol import AddRequest, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    ttfts, tpots = [], []
    for i in range(reps + 1):
        llm.engine.kv.reset_prefix_cache()
        llm.engine.add_request(AddRequest(f"single-{i}", prompts[i], sp))
        t0 = time.perf_counter()
        stamps = []
        while llm.engine.has_work:
            if llm.engine.step().outputs:
                stamps.append(time.perf_counter())
        if i == 0:
            continue  # warm-up
        ttfts.append(stamps[0] - t0)
        tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return {"ttft_ms": 1000 * statistics.median(ttfts), "tpot_ms": 1000 * statistics.median(tpots)}


def resident_mb() -> dict[str, float]:
    """This process's resident memory now and at its peak (Linux), MB."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = round(int(rest.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out


def run_format(fmt: str, args: argparse.Namespace) -> dict[str, Any]:
    """Load the default model in weight format ``fmt`` (``DTYPE:QUANT[:KV]``) in this
    process and run the batch and single-stream workloads."""
    from structllm import LLM

    dtype, quant, kv = (fmt.split(":") + ["auto", "auto"])[:3]
    t = time.perf_counter()
    llm = LLM(
        max_num_seqs=max(64, args.num_prompts),
        dtype=dtype,
        quantization=quant or "auto",
        kv_cache_dtype=kv or "auto",
        speculative_config={"method": "none"},  # plain decoding, as transformers'
    )
    load_s = time.perf_counter() - t
    mem_loaded = resident_mb()
    prompts = make_prompts(llm.engine.vocab_size, args.num_prompts, args.input_len)
    ours = bench_structllm(llm, prompts, args.output_len)
    single = single_stream_structllm(llm, prompts, args.output_len, args.single_reps)
    result = {
        "format": fmt,
        "weights": llm.engine.weight_format.describe(),
        "kv_cache_dtype": str(llm.engine.kv_dtype).removeprefix("torch."),
        "load_s": round(load_s, 2),
        "tokens_per_s": round(ours["tokens_per_s"], 1),
        "ttft_ms": round(single["ttft_ms"], 1),
        "tpot_ms": round(single["tpot_ms"], 2),
        "weight_mb": round(llm.engine.model.weight_bytes() / 1e6, 1),
        "rss_loaded_mb": mem_loaded.get("VmRSS"),
        "kv_cache_mb": round(
            sum(t.numel() * t.element_size() for kv in llm.engine.runner.kv_caches for t in kv)
            / 1e6,
            1,
        ),
        "rss_peak_mb": resident_mb().get("VmHWM"),
    }
    if args.profile:
        result["step_profile"] = profile_step(llm, prompts)
    return result


def run_format_subprocess(fmt: str, argv: list[str]) -> dict[str, Any]:
    import subprocess

    out = subprocess.run(
        [sys.executable, __file__, *argv, "--worker-format", fmt],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def load_hf() -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from structllm.model.files import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def bench_hf(model: Any, prompts: list[list[int]], out_len: int, batch: int) -> dict[str, float]:
    import torch

    def gen(chunk: list[list[int]], n: int) -> int:
        ids = torch.tensor(chunk)  # equal lengths: no padding needed
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
            )
        return int(out.shape[0] * (out.shape[1] - ids.shape[1]))

    gen(prompts[:2], 4)
    t = time.perf_counter()
    n = sum(gen(prompts[i : i + batch], out_len) for i in range(0, len(prompts), batch))
    dt = time.perf_counter() - t
    return {"output_tokens": n, "seconds": dt, "tokens_per_s": n / dt}


def single_stream_hf(
    model: Any, prompts: list[list[int]], out_len: int, reps: int
) -> dict[str, float]:
    import torch
    from transformers import TextStreamer

    class Stamps(TextStreamer):  # put() is called once with the prompt, then per token
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    ttfts, tpots = [], []
    for i in range(reps + 1):
        s = Stamps()
        ids = torch.tensor([prompts[i]])
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=out_len,
                min_new_tokens=out_len,
                do_sample=False,
                streamer=s,
            )
        if i == 0:
            continue
        tok = s.times[1:]
        ttfts.append(tok[0] - t0)
        tpots.append((tok[-1] - tok[0]) / (len(tok) - 1))
    return {"ttft_ms": 1000 * statistics.median(ttfts), "tpot_ms": 1000 * statistics.median(tpots)}


def profile_step(llm: Any, prompts: list[list[int]]) -> dict[str, float]:
    """Where one decode step of the whole batch goes (ms): attention, the rest of the
    model, LM head, sampling, and Python (scheduling, batch building, bookkeeping)."""
    import torch

    import structllm.model.llama as llama
    from structllm.protocol import AddRequest, SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(AddRequest(f"prof-{i}", p, sp))
    while any(
        r.num_computed_tokens < r.prompt_len
        for r in [*eng.scheduler.running, *eng.scheduler.waiting]
    ):
        eng.step()  # finish all prefills
    for _ in range(2):
        eng.step()

    acc = {"attention": 0.0, "sampler": 0.0, "lm_head": 0.0}
    real_attn, real_sampler, real_logits = (
        llama.attention,
        eng.runner.sampler,
        eng.model.compute_logits,
    )

    def timed(key: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t

        return wrapper

    # attention as each layer path calls it: the plain one (attention), the fused CPU
    # one (attend for steps with prefill rows, the backend's decode_rows for decode-only)
    real_attend = llama.attend
    impl = eng.model.attn_impl
    llama.attention = timed("attention", real_attn)  # type: ignore[assignment]
    llama.attend = timed("attention", real_attend)  # type: ignore[assignment]
    if hasattr(impl, "decode_rows"):
        impl.decode_rows = timed("attention", impl.decode_rows)  # type: ignore[attr-defined]
    eng.runner.sampler = timed("sampler", real_sampler)
    eng.model.compute_logits = timed("lm_head", real_logits)  # type: ignore[method-assign]
    steps, model_s, total_s = 8, 0.0, 0.0
    real_forward = eng.model.forward
    try:

        def fwd(*a: Any, **k: Any) -> Any:
            nonlocal model_s
            t = time.perf_counter()
            try:
                return real_forward(*a, **k)
            finally:
                model_s += time.perf_counter() - t

        eng.model.forward = fwd  # type: ignore[method-assign]
        for _ in range(steps):
            t = time.perf_counter()
            eng.step()
            total_s += time.perf_counter() - t
    finally:
        llama.attention = real_attn  # type: ignore[assignment]
        llama.attend = real_attend  # type: ignore[assignment]
        if "decode_rows" in vars(impl):
            del impl.decode_rows
        eng.runner.sampler = real_sampler
        del eng.model.compute_logits
        del eng.model.forward
        eng.abort([f"prof-{i}" for i in range(len(prompts))])
    ms = lambda s: round(1000 * s / steps, 2)  # noqa: E731
    return {
        "batch": len(prompts),
        "step_ms": ms(total_s),
        "attention_ms": ms(acc["attention"]),
        "model_other_ms": ms(model_s - acc["attention"]),
        "lm_head_ms": ms(acc["lm_head"]),
        "sampler_ms": ms(acc["sampler"]),
        "python_ms": ms(total_s - model_s - acc["lm_head"] - acc["sampler"]),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--single-reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="16 prompts, 64 output tokens")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--profile", action="store_true", help="break one decode step down")
    ap.add_argument(
        "--formats",
        default="float32:none,auto:auto",
        help=(
            "comma-separated DTYPE:QUANTIZATION[:KV_CACHE_DTYPE] formats to run (first = baseline)"
        ),
    )
    ap.add_argument("--worker-format", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.output_len, args.single_reps = 16, 64, 2
    if args.worker_format:
        print(json.dumps(run_format(args.worker_format, args)))
        return

    argv = [a for a in sys.argv[1:] if a != "--quick"] + (
        [
            "--num-prompts",
            str(args.num_prompts),
            "--output-len",
            str(args.output_len),
            "--single-reps",
            str(args.single_reps),
        ]
        if args.quick
        else []
    )
    formats = [run_format_subprocess(f.strip(), argv) for f in args.formats.split(",") if f.strip()]
    result: dict[str, Any] = {
        "bench": "offline_throughput",
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "formats": formats,
    }
    if not args.no_hf:
        hf = load_hf()
        prompts = make_prompts(hf.config.vocab_size, args.num_prompts, args.input_len)
        theirs = bench_hf(hf, prompts, args.output_len, args.hf_batch)
        theirs_single = single_stream_hf(hf, prompts, args.output_len, args.single_reps)
        result.update(
            hf_tokens_per_s=round(theirs["tokens_per_s"], 1),
            hf_ttft_ms=round(theirs_single["ttft_ms"], 1),
            hf_tpot_ms=round(theirs_single["tpot_ms"], 2),
        )
    base = formats[0]
    head = (
        f"{'format':22}{'tokens/s':>10}{'TTFT ms':>9}{'ms/token':>10}{'x base':>8}"
        f"{'weights MB':>12}"
        f"{'RSS MB':>8}{'RSS-KV MB':>11}"
    )
    print(head, file=sys.stderr)
    for f in formats:
        print(
            f"{f['format']:22}{f['tokens_per_s']:>10}{f['ttft_ms']:>9}{f['tpot_ms']:>10}"
            f"{base['tpot_ms'] / f['tpot_ms']:>8.2f}{f['weight_mb']:>12}{f['rss_loaded_mb']!s:>8}"
            f"{(f['rss_loaded_mb'] or 0) - f['kv_cache_mb']:>11.0f}",
            file=sys.stderr,
        )
        print(f"{'':22}({f['weights']}, {f['kv_cache_dtype']} KV cache)", file=sys.stderr)
        if "step_profile" in f:
            p = f["step_profile"]
            print(
                f"{'':22}decode step at batch {p['batch']}: {p['step_ms']} ms "
                f"({p['step_ms'] / p['batch']:.2f} "
                f"ms/token), attention {p['attention_ms']} ms",
                file=sys.stderr,
            )
    if "hf_tokens_per_s" in result:
        print(
            f"{'transformers':22}{result['hf_tokens_per_s']:>10}{result['hf_ttft_ms']:>9}{result['hf_tpot_ms']:>10}",
            file=sys.stderr,
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
