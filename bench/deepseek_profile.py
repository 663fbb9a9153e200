"""Where a DeepSeek decode step's thread CPU goes, by piece (one kernel thread).

Runs ``--streams`` greedy streams together (128-token prompts, ``--output-len`` tokens)
on one GGUF file and wraps the pieces of a decode step with ``time.thread_time`` timers
(self time: a piece's children are not counted in it): cpu_mla.cpp's calls (``mla.*``),
the fused CPU ops (``ops.*``), the block matmuls of the attention, the dense MLP and the
shared experts (``deepseek.linear``), the routed experts' one call, the logits, and the
Python around them. With ``--threads 1`` every kernel runs on the calling thread, so
the pieces add up to the step (the timers cost a few microseconds each). The native
decode loop runs a step in one call per segment, so it shows as ``native loop``:
``--python-loop`` keeps DeepseekModel._forward_native to see the pieces.

    python bench/deepseek_profile.py FILE.gguf [--streams 16] [--python-loop]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.models import prompts

ACC: collections.Counter[str] = collections.Counter()
STACK: list[float] = []  # the running timers' children's time
ON = [False]  # timing on (decode steps only)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its self time (thread CPU) added to ``ACC[name]`` while ``ON``."""

    def wrapper(*a: Any, **k: Any) -> Any:
        if not ON[0]:
            return fn(*a, **k)
        c = time.thread_time()
        STACK.append(0.0)
        try:
            return fn(*a, **k)
        finally:
            spent = time.thread_time() - c
            ACC[name] += spent - STACK.pop()
            if STACK:
                STACK[-1] += spent

    return wrapper


class Timed:
    """A module whose callables are ``timed`` under ``prefix`` + their names."""

    def __init__(self, module: Any, prefix: str) -> None:
        self._m, self._p = module, prefix

    def __getattr__(self, name: str) -> Any:
        f = getattr(self._m, name)
        return timed(self._p + name, f) if callable(f) else f


def instrument(model: Any) -> None:
    import structllm.model.deepseek as ds
    import structllm.model.layers as layers

    if model.mla is not None:
        model.mla = Timed(model.mla, "mla.")
        for layer in model.layers:
            if layer.moe is not None:
                layer.moe.native_router = model.mla
    model.cpu_ops = Timed(model.cpu_ops, "ops.")
    ds.linear = timed("block matmuls (attention, dense, shared)", ds.linear)
    layers.SparseMoe.routed = timed("routed experts", layers.SparseMoe.routed)
    ds.DeepseekLayer.forward_native = timed("python: layer", ds.DeepseekLayer.forward_native)
    ds.LatentAttention.forward_native = timed(
        "python: attention", ds.LatentAttention.forward_native
    )
    ds.DeepseekMoe._add_shared = timed("python: shared experts", ds.DeepseekMoe._add_shared)
    ds.DeepseekModel.forward = timed("python: model.forward", ds.DeepseekModel.forward)
    type(model).compute_logits = timed("logits", type(model).compute_logits)
    plan = model._native_plan()
    if plan is not None:
        plan.native = Timed(plan.native, "native loop: ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--python-loop", action="store_true", help="not the native decode loop")
    args = ap.parse_args()
    import torch

    from structllm import LLM, SamplingParams
    from structllm.protocol import AddRequest

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
    model.native_decode = not args.python_loop
    instrument(model)
    ps = prompts(args.streams + 2, 128)
    llm.generate(ps[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for r in range(args.rounds):
        llm.engine.kv.reset_prefix_cache()
        for i, ids in enumerate(ps[: args.streams]):
            llm.engine.add_request(AddRequest(f"r{r}-{i}", ids, sp))
        started: set[str] = set()
        steps, total = 0, 0.0
        ACC.clear()
        while llm.engine.has_work:
            ON[0] = len(started) == args.streams  # every prompt was in an earlier step
            STACK.append(0.0)
            c = time.thread_time()
            out = llm.engine.step().outputs
            spent = time.thread_time() - c
            child = STACK.pop()
            if ON[0] and out:
                steps += 1
                total += spent
                ACC["engine step (sampler, scheduler, ...)"] += spent - child
            started.update(d.request_id for d in out)
        load = Path("/proc/loadavg").read_text().split()[0]
        print(
            f"round {r}: {steps} decode steps of {args.streams} rows, "
            f"{total / steps * 1e3:.2f} ms thread CPU a step ({model.decode_path} loop); "
            f"load {load}"
        )
        for name, v in sorted(ACC.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<42} {v / steps * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
