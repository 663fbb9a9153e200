r"""A mixture-of-experts decode step: the experts in one native call per layer
(``cpu_moe.cpp``) against the per-expert Python loop it replaced, in one process,
alternating step by step (A/B/B/A: no arm always on even steps), at one and at
``--batch`` running sequences.

Prints the median and the fastest step time of each arm (under load a median includes
waits for descheduled threads), their ratio and the load average, and the
weight bytes of the dense matrices, the head and one expert per layer (a batch-1 step
reads the dense ones, the head and ``top_k`` experts per layer).

With ``--split``, the native arm's steps are also split by wall time into the router
(``SparseMoe.route``), the experts' native call, attention (``decode_rows``), the other
block matmuls (q/k/v, o, the head: ``llama.linear``) and the rest; and a batch-1 step is
set against its active bytes (the dense matrices, the head and ``top_k`` experts per
layer) at the row kernel's speed, measured in the same run: one row through every
expert matrix in turn, a ``linear`` call each (more bytes than the caches hold, so they
stream from memory, as a step's do).

With ``--kernels``, one layer's experts at each batch size (its router's choices for
random hidden states) as the native call against the same block kernels called once per
used expert and matrix from Python (``packed.linear``: each on both threads), fastest of
``--reps`` runs each, interleaved: whether the native call costs what its kernels cost
(each expert's weights read once for all its tokens, both threads busy), and the
tokens per expert the kernels see.

    python bench/moe_step.py MODEL.gguf [--batch 16] [--steps 24] [--split] [--kernels]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SPLIT_PARTS = ("router", "experts", "attention", "other matmuls")


@contextmanager
def split_timers(parts: dict[str, float], native: list[Any] | None) -> Iterator[None]:
    """Within the block, add the wall time of the step's parts into ``parts`` (when
    ``native`` is given: the layers' native experts, in order)."""
    if native is None:
        yield
        return
    import structllm.model.llama as llama
    from structllm.kernels.attention import CpuAttention
    from structllm.model.layers import SparseMoe

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[name] += time.perf_counter() - t

        return call

    class Timed:  # the native Experts (a pybind11 object) with its forward timed
        def __init__(self, n: Any) -> None:
            self.forward = timed("experts", n.forward)

    saved = (SparseMoe.route, CpuAttention.decode_rows, llama.linear)
    moes = [layer.moe for layer in _model_layers() if layer.moe is not None]
    SparseMoe.route = timed("router", SparseMoe.route)  # type: ignore[method-assign]
    CpuAttention.decode_rows = timed("attention", CpuAttention.decode_rows)  # type: ignore[method-assign]
    llama.linear = timed("other matmuls", llama.linear)
    for m, n in zip(moes, native, strict=True):
        m.native = Timed(n)
    try:
        yield
    finally:
        SparseMoe.route, CpuAttention.decode_rows, llama.linear = saved  # type: ignore[method-assign]
        for m, n in zip(moes, native, strict=True):
            m.native = n


_LLM: Any = None


def _model_layers() -> Any:
    return _LLM.engine.runner.model.layers


def row_kernel_bytes_per_s(model: Any, passes: int = 3) -> float:
    """The row kernel's speed on weights from memory: bytes/s of one row through every
    expert matrix of every layer in turn, each by its own ``linear`` call (more bytes
    than the caches hold), the fastest of ``passes`` passes."""
    import torch

    from structllm.kernels.packed import linear, weight_bytes

    mats = [
        (w, torch.randn(1, w.shape[1]))
        for layer in model.layers
        if layer.moe is not None
        for e in layer.moe.experts
        for w in (e.gate_up_proj, e.down_proj)
    ]
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        for w, x in mats:
            linear(x, w, int8_ok=True)
        best = min(best, time.perf_counter() - t)
    return sum(weight_bytes(w) for w, _ in mats) / best


def layer_kernels(model: Any, batch: int, reps: int) -> str:
    """The first MoE layer's experts at ``batch`` tokens: the native call against the
    per-expert kernel calls it stands for (fastest of ``reps``, interleaved)."""
    import torch

    from structllm.kernels.packed import linear

    moe = next(layer.moe for layer in model.layers if layer.moe is not None)
    native = moe.native_experts()
    torch.manual_seed(batch)
    h = torch.randn(batch, moe.hidden)
    weights, chosen = moe.route(h, True)
    counts = torch.bincount(chosen.flatten(), minlength=len(moe.experts)).tolist()
    xs = {m: (torch.randn(m, moe.hidden), torch.randn(m, moe.ffn)) for m in counts if m}

    def kernels() -> None:
        for e, m in enumerate(counts):
            if m:
                linear(xs[m][0], moe.experts[e].gate_up_proj, int8_ok=True)
                linear(xs[m][1], moe.experts[e].down_proj, int8_ok=True)

    arms: dict[str, Callable[[], Any]] = {
        "native": lambda: native.forward(h, chosen, weights),
        "kernels": kernels,
    }
    best = dict.fromkeys(arms, float("inf"))
    for _ in range(reps):
        for name, fn in arms.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return (
        f"   one layer's experts, tokens per expert {counts}: "
        f"native {best['native'] * 1e3:.3f} ms, "
        f"its kernels called per expert {best['kernels'] * 1e3:.3f} ms "
        f"(native/kernels {best['native'] / best['kernels']:.2f}x, fastest of {reps})"
    )


def head_of(model: Any) -> Any:
    """The weight the head's matmul reads (its packed copy, if any)."""
    if model._packed_head is not None:
        return model._packed_head
    return model.embed_tokens if model.lm_head is None else model.lm_head


def arm_steps(
    llm: Any, batch: int, steps: int, input_len: int, split: bool = False
) -> dict[str, list[float]]:
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
    times: dict[str, list[float]] = defaultdict(list)
    for s in range(steps):
        arm = "native" if s % 4 in (0, 3) else "loop"  # A/B/B/A
        for m, n in zip(moes, native, strict=True):
            m.native = n if arm == "native" else False
        parts: dict[str, float] = defaultdict(float)
        with split_timers(parts, native if arm == "native" and split else None):
            t = time.perf_counter()
            llm.engine.step()
            times[arm].append(time.perf_counter() - t)
        for name in SPLIT_PARTS if arm == "native" and split else ():
            times[name].append(parts[name])
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
    ap.add_argument("--split", action="store_true", help="split the native arm's steps")
    ap.add_argument("--kernels", action="store_true", help="one layer: native call vs its kernels")
    ap.add_argument("--reps", type=int, default=40, help="--kernels: runs of each arm")
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_memory=256 << 20, max_num_seqs=32)
    global _LLM
    _LLM = llm
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
    head_bytes = weight_bytes(head_of(model))
    k = cfg.num_experts_per_tok
    print(
        f"# {Path(args.model).name}: {cfg.num_layers} layers, {cfg.num_experts} experts, top {k}; "
        f"dense matrices {dense / 2**20:.1f} MiB, head {head_bytes / 2**20:.1f} MiB, "
        f"one expert in every layer {expert_bytes / 2**20:.1f} MiB"
    )
    active = dense + head_bytes + k * expert_bytes  # bytes a batch-1 step reads
    for batch in (1, args.batch):
        times = arm_steps(llm, batch, args.steps, args.input_len, args.split)
        nat, loop = (statistics.median(times[a]) * 1e3 for a in ("native", "loop"))
        load = Path("/proc/loadavg").read_text().split()[0]
        print(
            f"batch {batch:>3}: native {nat:7.2f} ms/step, loop {loop:7.2f} ms/step, "
            f"loop/native {loop / nat:.2f}x (median of {len(times['native'])} steps each, "
            f"alternating; load {load})",
            flush=True,
        )
        # under load a median step includes waits for descheduled threads; the fastest
        # step of each arm is the one that ran undisturbed
        fast_nat, fast_loop = (min(times[a]) * 1e3 for a in ("native", "loop"))
        print(
            f"   fastest step: native {fast_nat:.2f} ms, loop {fast_loop:.2f} ms, "
            f"loop/native {fast_loop / fast_nat:.2f}x"
        )
        if args.split:
            mean = statistics.mean(times["native"])
            shares = {p: statistics.mean(times[p]) for p in SPLIT_PARTS}
            shares["rest"] = mean - sum(shares.values())
            print(
                "   native step split (mean ms): "
                + ", ".join(f"{p} {v * 1e3:.2f} ({v / mean:.0%})" for p, v in shares.items())
            )
            if batch == 1:
                bps = row_kernel_bytes_per_s(model)
                floor = active / bps
                print(
                    f"   active bytes {active / 2**20:.1f} MiB at the row kernel's "
                    f"{bps / 1e9:.2f} GB/s (one row, every expert in turn): {floor * 1e3:.2f} ms; "
                    f"the native step is {nat / 1e3 / floor:.2f}x that; its experts "
                    f"{statistics.median(times['experts']) * 1e3:.2f} ms against "
                    f"{k * expert_bytes / bps * 1e3:.2f} ms for {k} experts' bytes"
                )
        if args.kernels:
            print(layer_kernels(model, batch, args.reps), flush=True)
    llm.close()


if __name__ == "__main__":
    main()
