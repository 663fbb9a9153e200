"""An encoder's attention on the fused path, before and after cpu_layer.cpp's
``encoder_attention`` (issue #42): bge-base's shape (12 heads of 64) in process, the two
arms alternating in each round so that a loaded machine's neighbours hit both alike.

- ``bmm (before)``: what ``BertLayer.encode_fused`` ran until then, kept here as the
  baseline: per prompt, two batched matmuls (MKL) and torch's softmax over tiles of
  query rows, with the transposing copies in and out;
- ``c++ (after)``: ``ops.encoder_attention`` on the kernels' pool (which also adds the
  q/k/v bias as it packs the rows: the baseline runs ``bias_add_`` first).

Two measurements: the attention of one layer alone (random q, k, v of ``--passages``
prompts of 256-510 tokens; thread CPU ms at one thread, the work whatever the load),
and ``LLM.embed`` of the same prompts' texts on the bge-base Q8_0 file at ``--threads``
(thread CPU of this thread, which at one thread holds all the work; the process's CPU,
which at two also counts the OpenMP and pool threads; wall), medians of ``--rounds``.

    python bench/encoder_attention.py [--threads 2] [--rounds 3] [--passages 8]

``STRUCTLLM_CPU_ISA=avx2``: the AVX2 kernels, and MKL / oneDNN / ATen held to AVX2 too
(``embeddings.hold_to_avx2``), so that the baseline's matmuls are AVX2 ones.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import embeddings as bench  # noqa: E402  (the synthetic model, texts, hold_to_avx2)

bench.hold_to_avx2()  # before torch loads

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

HEADS, HEAD_DIM = 12, 64  # BERT-base


def scores_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, tile: int = 4 << 20) -> Tensor:
    """The baseline (``model.bert.scores_attention`` until this change): ``q, k, v:
    [H, n, D]`` -> ``[H, n, D]``, batched matmuls and a softmax, ``tile`` floats of
    scores at a time."""
    h, n, _ = q.shape
    rows = max(1, tile // (h * k.shape[1]))
    if rows >= n:
        return torch.bmm(torch.bmm(q, k.transpose(1, 2)).mul_(scale).softmax(-1), v)
    out = q.new_empty(h, n, v.shape[2])
    for r in range(0, n, rows):
        sc = torch.bmm(q[:, r : r + rows], k.transpose(1, 2)).mul_(scale)  # [H, rows, n]
        out[:, r : r + rows] = torch.bmm(sc.softmax(-1), v)
    return out


def bmm_attention(q: Tensor, k: Tensor, v: Tensor, starts: list[int], scale: float) -> Tensor:
    """``q, k, v: [T, H, D]`` -> ``[T, H, D]`` the baseline's way, one prompt at a time."""
    out = torch.empty_like(q)
    for s, e in itertools.pairwise(starts):
        qb, kb, vb = (x[s:e].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        out[s:e] = scores_attention(qb, kb, vb, scale).transpose(0, 1)
    return out


class BmmOps:
    """The layer ops with the baseline's attention (for ``BertLayer.ops``)."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)

    def encoder_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        starts: list[int],
        scale: float,
        bias: Tensor | None = None,
    ) -> Tensor:
        if bias is not None:  # the baseline's own pass: bias_add_ on the whole [T, 3 H D]
            t, h, d = q.shape
            self.ops.bias_add_(torch.as_strided(q, (t, 3 * h * d), (3 * h * d, 1)), bias)
        return bmm_attention(q, k, v, starts, scale)


def timed(fn: Callable[[], object]) -> tuple[float, float, float]:
    """(thread CPU s, process CPU s, wall s) of one call."""
    t, c, w = time.thread_time(), time.process_time(), time.perf_counter()
    fn()
    return time.thread_time() - t, time.process_time() - c, time.perf_counter() - w


def alternate(
    arms: dict[str, Callable[[], object]], rounds: int
) -> dict[str, list[tuple[float, float, float]]]:
    """Each arm once a round, in order; ``rounds`` rounds after one warm-up round."""
    for fn in arms.values():
        fn()
    out: dict[str, list[tuple[float, float, float]]] = {a: [] for a in arms}
    for _ in range(rounds):
        for a, fn in arms.items():
            out[a].append(timed(fn))
    return out


def report(title: str, res: dict[str, list[tuple[float, float, float]]], unit: float) -> None:
    """Medians of each arm, and each against the first arm."""
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"{title} (load {load})")
    med = {a: [statistics.median(x[i] for x in r) for i in range(3)] for a, r in res.items()}
    base = next(iter(med.values()))
    names = ("thread CPU", "process CPU", "wall")
    for a, m in med.items():
        cells = [
            f"{n} {unit * v:9.1f} ({v / b:.3f}x)" for n, v, b in zip(names, m, base, strict=True)
        ]
        print(f"  {a:14} " + "  ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passages", type=int, default=8)
    args = ap.parse_args()

    from structllm import LLM
    from structllm.kernels import cpu_ext
    from tests.support.llamacpp import convert_hf

    ops = cpu_ext.load_layer()
    assert ops is not None, "the fused ops did not build"
    lo, hi = bench.passage_words("bge-base")
    rng = random.Random(1)
    starts = [0]
    for _ in range(args.passages):
        starts.append(starts[-1] + rng.randint(lo, hi))
    qkv = torch.randn(starts[-1], 3 * HEADS, HEAD_DIM)
    q, k, v = (qkv[:, i * HEADS : (i + 1) * HEADS] for i in range(3))  # [T, H, D] views
    scale = HEAD_DIM**-0.5
    print(f"ISA {cpu_ext.best_isa()}, {args.passages} prompts, {starts[-1]} tokens")
    torch.set_num_threads(1)
    one = {
        "bmm (before)": lambda: bmm_attention(q, k, v, starts, scale),
        "c++ (after)": lambda: ops.encoder_attention(q, k, v, starts, scale),
    }
    report("one layer's attention, 1 thread, ms", alternate(one, 2 * args.rounds + 1), 1000)

    torch.set_num_threads(args.threads)
    q8 = convert_hf(bench.synthetic_model("bge-base"), "q8_0", pre="bert-bge")
    passages = bench.texts(args.passages, lo, hi, 2)
    with LLM(
        str(q8), max_num_batched_tokens=16384, kv_cache_memory=64 << 20, num_threads=args.threads
    ) as llm:
        layers = llm.engine.runner.model.layers
        fused = layers[0].ops
        assert fused is not None, "the fused path is not in use"

        def embed(layer_ops: Any) -> Callable[[], object]:
            def run() -> object:
                for layer in layers:
                    layer.ops = layer_ops
                return llm.embed(passages)

            return run

        arms = {"bmm (before)": embed(BmmOps(fused)), "c++ (after)": embed(fused)}
        res = alternate(arms, args.rounds)
    report(f"LLM.embed of {args.passages} passages, {args.threads} threads, s", res, 1)


if __name__ == "__main__":
    main()
