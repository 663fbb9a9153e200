r"""A mixture-of-experts decode step: the experts in one native call per layer
(``cpu_moe.cpp``) against the per-expert Python loop it replaced, in one process,
alternating step by step (A/B/B/A: no arm always on even steps), at one and at
``--batch`` running sequences.

Prints the median and the fastest step time of each arm (under load a median includes
waits for descheduled threads), their ratio and the load average, and the
weight bytes of the dense matrices, the head and one expert per layer (a batch-1 step
reads the dense ones, the head and ``top_k`` experts per layer).

With the native decode loop (GGUF blocks), a third arm, ``cut``: the same native experts
called from Python between two native layer calls, cut after each MoE layer (how they
ran before the loop ran them inside its calls; the ``loop`` arm's plan is cut alike).

With ``--split``, the native arm's steps (the ``cut`` arm's, when there is one: the split
times Python calls) are also split by wall time into the router
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

With ``--fbgemm`` (experts in float16 rows, ``HalfMatrix``: a float16/bfloat16
directory), a third arm: the per-expert loop over fbgemm's packed float16 copies of the
same weights (``HalfWeight``), the path such experts took before the native call ran
them; arms rotate A/B/C/C/B/A. ``--rss`` loads the model in two fresh child processes,
one as now and one with the experts packed for fbgemm as before (``half_experts`` off),
and prints each one's resident memory after loading and after a short generation.

MODEL is a file or directory, or ``FAMILY:DTYPE`` (``mixtral:float16``): that family's
directory at ``bench/models.py``'s bench shape, saved in DTYPE (built and cached like
the tests' models).

    python bench/moe_step.py MODEL [--batch 16] [--steps 24] [--split] [--kernels]
        [--fbgemm] [--rss]
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

# plain decode steps: the steps timed here are the model's, not speculative decoding's
PLAIN = {"method": "none"}

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


def fbgemm_copies(moes: list[Any]) -> list[list[tuple[Any, Any]]]:
    """Per layer and expert: fbgemm's packed copies (``HalfWeight``) of its float16 rows."""
    from structllm.kernels.packed import HalfMatrix, HalfWeight

    out = []
    for m in moes:
        pairs = []
        for e in m.experts:
            assert isinstance(e.gate_up_proj, HalfMatrix), "--fbgemm: experts not float16 rows"
            pairs.append((HalfWeight(e.gate_up_proj.half()), HalfWeight(e.down_proj.half())))
        out.append(pairs)
    return out


def set_experts(moes: list[Any], weights: list[list[tuple[Any, Any]]]) -> None:
    for m, pairs in zip(moes, weights, strict=True):
        for e, (gate_up, down) in zip(m.experts, pairs, strict=True):
            e.gate_up_proj, e.down_proj = gate_up, down


def arm_steps(
    llm: Any, batch: int, steps: int, input_len: int, split: bool = False, fbgemm: bool = False
) -> dict[str, list[float]]:
    from structllm import SamplingParams
    from structllm.protocol import AddRequest

    model = llm.engine.runner.model
    moes = [layer.moe for layer in model.layers if layer.moe is not None]
    native = [m.native_experts() for m in moes]
    assert all(n is not None for n in native), "the experts are not block weights"
    arms = ["native", "loop", "fbgemm"] if fbgemm else ["native", "loop"]
    plans = native_plans(model)
    if plans is not None and not fbgemm:
        arms.append("cut")
    # --split times Python calls: the experts inside the native calls are not one
    split_arm = "cut" if "cut" in arms else "native"
    rows = [[(e.gate_up_proj, e.down_proj) for e in m.experts] for m in moes]
    packed = fbgemm_copies(moes) if fbgemm else rows
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
        turn = arms if (s // len(arms)) % 2 == 0 else arms[::-1]  # A/B/B/A, A/B/C/C/B/A
        arm = turn[s % len(arms)]
        for m, n in zip(moes, native, strict=True):
            m.native = n if arm in ("native", "cut") else False
        set_experts(moes, packed if arm == "fbgemm" else rows)
        if plans is not None:  # the experts inside the native calls, or between them
            model._decode_plan = plans[0] if arm == "native" else plans[1]
        parts: dict[str, float] = defaultdict(float)
        with split_timers(parts, native if arm == split_arm and split else None):
            t = time.perf_counter()
            llm.engine.step()
            times[arm].append(time.perf_counter() - t)
        for name in SPLIT_PARTS if arm == split_arm and split else ():
            times[name].append(parts[name])
    for m, n in zip(moes, native, strict=True):
        m.native = n
    set_experts(moes, rows)
    if plans is not None:
        model._decode_plan = plans[0]
    while llm.engine.has_work:
        llm.engine.step()
    return times


def native_plans(model: Any) -> tuple[Any, Any] | None:
    """With the native decode loop: its plan (the experts inside its calls) and one
    whose calls end at each MoE layer's MLP input (the experts called from Python
    between them, as before they ran inside); None on the Python loop."""
    from structllm.model import decode_plan

    inside = model._native_plan()
    if inside is None:
        return None
    keep = decode_plan._native_experts
    decode_plan._native_experts = lambda dl: None
    try:
        model._decode_plan = None
        cut = model._native_plan()
    finally:
        decode_plan._native_experts = keep
        model._decode_plan = inside
    return inside, cut


def model_path(spec: str) -> str:
    """A path as given, or ``FAMILY:DTYPE``'s bench-shape directory in DTYPE."""
    if ":" not in spec or Path(spec).exists():
        return spec
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support, bench
    from bench.models import BENCH_SHAPES
    from structllm.model.loader import prepare_model
    from tests.support.models import tiny_family_dir_in

    family, dtype = spec.split(":")
    return str(tiny_family_dir_in(family, prepare_model(None), dtype, **BENCH_SHAPES[family]))


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_child(model: str, arm: str) -> None:
    """Load ``model`` (``arm`` "old": experts packed for fbgemm, as before) and print
    the resident memory after loading and after 16 sequences of 16 tokens."""
    from structllm import LLM, SamplingParams
    from structllm.model.layers import SparseMoe

    if arm == "old":
        SparseMoe.half_experts = lambda self, half: None  # type: ignore[method-assign]
    llm = LLM(model, kv_cache_memory=256 << 20, max_num_seqs=32, speculative_config=PLAIN)
    loaded = rss_mib()
    rng = random.Random(0)
    ids = [[rng.randrange(100, 49000) for _ in range(32)] for _ in range(16)]
    llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    kind = type(
        next(layer.moe for layer in llm.engine.runner.model.layers if layer.moe)
        .experts[0]
        .down_proj
    )
    print(
        f"{arm} ({kind.__name__} experts): RSS after load {loaded:.0f} MiB, "
        f"after 16 x 16 tokens {rss_mib():.0f} MiB",
        flush=True,
    )
    llm.close()


def rss_arms(model: str) -> None:
    import subprocess
    import sys

    for arm in ("old", "new"):
        subprocess.run([sys.executable, __file__, model, "--rss-child", arm], check=True)


def main() -> None:
    from structllm import LLM
    from structllm.kernels.packed import weight_bytes

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model", help="a file or directory, or FAMILY:DTYPE at the bench shape")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--split", action="store_true", help="split the native arm's steps")
    ap.add_argument("--kernels", action="store_true", help="one layer: native call vs its kernels")
    ap.add_argument("--reps", type=int, default=40, help="--kernels: runs of each arm")
    ap.add_argument("--fbgemm", action="store_true", help="float16 rows: an fbgemm loop arm")
    ap.add_argument("--rss", action="store_true", help="RSS with the experts as before and now")
    ap.add_argument("--rss-child", choices=["old", "new"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = model_path(args.model)
    if args.rss_child:
        return rss_child(args.model, args.rss_child)
    if args.rss:
        return rss_arms(args.model)
    llm = LLM(args.model, kv_cache_memory=256 << 20, max_num_seqs=32, speculative_config=PLAIN)
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
        times = arm_steps(llm, batch, args.steps, args.input_len, args.split, args.fbgemm)
        nat, loop = (statistics.median(times[a]) * 1e3 for a in ("native", "loop"))
        load = Path("/proc/loadavg").read_text().split()[0]
        print(
            f"batch {batch:>3}: native {nat:7.2f} ms/step, loop {loop:7.2f} ms/step, "
            f"loop/native {loop / nat:.2f}x (median of {len(times['native'])} steps each, "
            f"alternating; load {load})",
            flush=True,
        )
        if "cut" in times:
            cut = statistics.median(times["cut"]) * 1e3
            print(
                f"   cut (native experts called from Python between native calls, as "
                f"before) {cut:7.2f} ms/step, cut/native {cut / nat:.2f}x; fastest "
                f"{min(times['cut']) * 1e3:.2f} ms against {min(times['native']) * 1e3:.2f} ms"
            )
        if args.fbgemm:
            fb = statistics.median(times["fbgemm"]) * 1e3
            print(
                f"   fbgemm loop (as before) {fb:7.2f} ms/step, fbgemm/native {fb / nat:.2f}x; "
                f"fastest {min(times['fbgemm']) * 1e3:.2f} ms"
            )
        # under load a median step includes waits for descheduled threads; the fastest
        # step of each arm is the one that ran undisturbed
        fast_nat, fast_loop = (min(times[a]) * 1e3 for a in ("native", "loop"))
        print(
            f"   fastest step: native {fast_nat:.2f} ms, loop {fast_loop:.2f} ms, "
            f"loop/native {fast_loop / fast_nat:.2f}x"
        )
        if args.split:
            split_arm = "cut" if "cut" in times else "native"
            mean = statistics.mean(times[split_arm])
            shares = {p: statistics.mean(times[p]) for p in SPLIT_PARTS}
            shares["rest"] = mean - sum(shares.values())
            print(
                f"   {split_arm} step split (mean ms): "
                + ", ".join(f"{p} {v * 1e3:.2f} ({v / mean:.0%})" for p, v in shares.items())
            )
            if batch == 1:
                bps = row_kernel_bytes_per_s(model)
                floor = active / bps
                print(
                    f"   active bytes {active / 2**20:.1f} MiB at the row kernel's "
                    f"{bps / 1e9:.2f} GB/s (one row, every expert in turn): {floor * 1e3:.2f} ms; "
                    f"the native step is {nat / 1e3 / floor:.2f}x that; "
                    f"the {split_arm} step's experts "
                    f"{statistics.median(times['experts']) * 1e3:.2f} ms against "
                    f"{k * expert_bytes / bps * 1e3:.2f} ms for {k} experts' bytes"
                )
        if args.kernels:
            print(layer_kernels(model, batch, args.reps), flush=True)
    llm.close()


if __name__ == "__main__":
    main()
