"""DeepSeek-V2/V3 decode steps with and without cpu_mla.cpp, in one process, interleaved.

One GGUF file in the default format; each round runs ``--streams`` greedy streams
together (128-token prompts, then ``--output-len`` tokens each) once per arm:

- ``torch``: the layers' torch path (``DeepseekModel.mla`` and every ``native_router``
  off: the absorbed attention by torch's batched matmuls, torch's router);
- ``python``: ``DeepseekModel._forward_native`` (cpu_mla.cpp's ``store_latent``,
  ``decode`` and ``group_route``, the fused CPU ops' norms) in a Python layer loop;
- ``native``: the same kernels in the native decode loop (``cpu_decode.cpp``), when the
  file's matrices are all in blocks (else it is the ``python`` arm again).

Printed per run: tokens/s (wall, over the decode steps after every prompt's prefill)
and the median such step's CPU time of the calling thread (``time.thread_time``; with
``--threads 1`` every kernel runs on that thread, so it is the step's whole CPU cost,
which a loaded machine disturbs less than wall time), then whether both arms chose the
same tokens.

    python bench/deepseek_decode.py FILE.gguf [--threads 1] [--rounds 3] [--output-len 48]
        [--streams 1]

The bench-shape file: ``python bench/models.py --families deepseek_v3 --shapes bench
--quant Q8_0 --gguf-only --no-default-model`` makes it (llama-quantize) under
``~/.cache/structllm/llamacpp/gguf``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.models import prompts

ARMS = ("torch", "python", "native")


def set_arm(model: Any, native: Any, arm: str) -> None:
    """The native latent attention and router on or off, and the native loop."""
    on = arm != "torch"
    model.mla = native if on else None
    model.native_decode = arm == "native"
    for layer in model.layers:
        if layer.moe is not None:
            layer.moe.native_router = native if on else None


def streams(llm: Any, rid: str, prompts: list[list[int]], n: int) -> tuple[float, float, list[int]]:
    """(tokens/s, median step thread-CPU seconds, first stream's tokens) of greedy
    streams run together, counted from the first step after every prompt's prefill."""
    from structllm import SamplingParams
    from structllm.protocol import AddRequest

    llm.engine.kv.reset_prefix_cache()
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for i, ids in enumerate(prompts):
        llm.engine.add_request(AddRequest(f"{rid}-{i}", ids, sp))
    stamps: list[float] = []
    cpu: list[float] = []
    tokens: list[int] = []
    started: set[str] = set()
    count = 0
    while llm.engine.has_work:
        c = time.thread_time()
        out = llm.engine.step().outputs
        spent = time.thread_time() - c
        decoding = len(started) == len(prompts)  # every prompt was in an earlier step
        started.update(d.request_id for d in out)
        tokens += [t for d in out if d.request_id == f"{rid}-0" for t in d.new_token_ids]
        if decoding and out:
            stamps.append(time.perf_counter())
            cpu.append(spent)
            count += sum(len(d.new_token_ids) for d in out)
    rate = count / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return rate, sorted(cpu)[len(cpu) // 2], tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--streams", type=int, default=1, help="greedy streams run together")
    args = ap.parse_args()
    import torch

    from structllm import LLM, SamplingParams

    llm = LLM(
        args.gguf,
        dtype="auto",
        quantization="auto",
        kv_cache_memory=256 << 20,
        max_num_seqs=32,
        speculative_config={"method": "none"},
    )
    torch.set_num_threads(args.threads)
    model = llm.engine.runner.model
    native = model.mla
    if native is None:
        sys.exit("cpu_mla.cpp is not in use for this file (not the fused CPU path?)")
    ps = prompts(args.streams + 2, 128)
    llm.generate(ps[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    best: dict[str, tuple[float, float]] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    for r in range(args.rounds):
        for arm in ARMS:
            set_arm(model, native, arm)
            group = [ps[(r + i) % len(ps)] for i in range(args.streams)]
            rate, cpu, toks = streams(llm, f"{arm}-{r}", group, args.output_len)
            tokens.setdefault((arm, r % 3), toks)
            b = best.get(arm, (0.0, float("inf")))
            best[arm] = (max(b[0], rate), min(b[1], cpu))
            load = Path("/proc/loadavg").read_text().split()[0]
            print(f"{arm:<7} {rate:6.1f} tok/s  step thread-CPU {cpu * 1e3:6.2f} ms  load {load}")
    for arm, (rate, cpu) in best.items():
        print(f"{arm:<7} best {rate:6.1f} tok/s, least median step thread-CPU {cpu * 1e3:6.2f} ms")
    same = all(
        tokens[("torch", k)] == tokens[(arm, k)] for arm in ARMS for k in range(min(3, args.rounds))
    )
    print(f"threads {args.threads}, streams {args.streams}; same tokens in every arm: {same}")
    print(f"decode steps: {model.decode_why}")


if __name__ == "__main__":
    main()
