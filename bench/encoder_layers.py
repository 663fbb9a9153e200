"""An encoder's layers in process: bge-base's shape (BERT-base: hidden 768, 12 layers,
MLP 3072) as llama.cpp's converter writes it in Q8_0, run by ``LLM.embed`` three ways on
the same loaded model, in interleaved rounds so that a loaded machine's neighbours hit
each alike, and sentence-transformers (float32, torch) on the same directory:

- ``torch glue, int16``: the layers before the fused path (bias adds, GELU, residual
  adds and LayerNorms as torch ops; Q8_0 matmuls with 16-bit activations);
- ``fused, int16``: cpu_layer.cpp's glue on the kernels' pool (``BertLayer.ops``);
- ``fused, int8``: and Q8_0's matmuls on the int8 path (``--cpu-activations int8``;
  what ``auto`` runs on an AVX-512 VNNI CPU).

Workloads: bulk, one call of 32 passages of 256-510 words (passages/s), and single
queries of 8-16 words one call each (median ms). Wall time (the machine's load in the
output) and the process's CPU time, medians of ``--rounds``.

    python bench/encoder_layers.py [--threads 2] [--rounds 3] [--queries 16] [--passages 32]

``--threads 1`` for the figures that do not depend on the machine's load
(``*_thread_cpu_*``: this thread's CPU time, which then holds all the work).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def timed(fn: Callable[[], object]) -> tuple[float, float, float]:
    """(wall s, process CPU s, this thread's CPU s) of one call. At ``--threads 1`` the
    engine and torch run on this thread alone: its CPU time is the work, whatever the
    machine's load (the process's also counts other threads' spinning)."""
    w, c, t = time.perf_counter(), time.process_time(), time.thread_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c, time.thread_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--passages", type=int, default=32, help="passages in the bulk call")
    args = ap.parse_args()

    import embeddings as bench  # bench/embeddings.py: the synthetic model and texts
    import torch
    from sentence_transformers import SentenceTransformer

    from structllm import LLM
    from structllm.kernels import packed
    from tests.support.llamacpp import convert_hf

    torch.set_num_threads(args.threads)
    model = bench.synthetic_model("bge-base")
    q8 = convert_hf(model, "q8_0", pre="bert-bge")
    passages = bench.texts(args.passages, *bench.passage_words("bge-base"), 2)
    queries = bench.texts(args.queries, 8, 16, 1)
    st = SentenceTransformer(str(model), device="cpu")
    results: dict[str, dict[str, list[float]]] = {}

    def record(arm: str, key: str, value: float) -> None:
        results.setdefault(arm, {}).setdefault(key, []).append(value)

    def run(arm: str, bulk: Callable[[], object], one: Callable[[str], object]) -> None:
        wall, cpu, mine = timed(bulk)
        record(arm, "bulk_passages_s", len(passages) / wall)
        record(arm, "bulk_cpu_s", cpu)
        record(arm, "bulk_thread_cpu_s", mine)
        lat = [timed(lambda q=q: one(q)) for q in queries]
        record(arm, "query_p50_ms", 1000 * statistics.median(x[0] for x in lat))
        record(arm, "query_thread_cpu_ms", 1000 * statistics.median(x[2] for x in lat))

    with LLM(
        str(q8), max_num_batched_tokens=16384, kv_cache_memory=64 << 20, num_threads=args.threads
    ) as llm:
        layers = llm.engine.runner.model.layers
        ops = layers[0].ops
        assert ops is not None, "the fused ops did not load"
        arms = {
            "torch glue, int16": (None, "int16"),
            "fused, int16": (ops, "int16"),
            "fused, int8": (ops, "int8"),
        }
        llm.embed(queries[:2])
        for _ in range(args.rounds):
            for arm, (o, activations) in arms.items():
                packed.set_cpu_activations(activations)  # (the engine runs in this process)
                for layer in layers:
                    layer.ops = o
                run(arm, lambda: llm.embed(passages), lambda q: llm.embed([q]))
            run(
                "sentence-transformers",
                lambda: st.encode(passages, batch_size=32),
                lambda q: st.encode([q]),
            )
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"threads {args.threads}, rounds {args.rounds}, load {' '.join(load)}")
    keys = ["bulk_passages_s", "bulk_cpu_s", "bulk_thread_cpu_s", "query_p50_ms"]
    keys += ["query_thread_cpu_ms"]
    print(f"{'arm':24}" + "".join(f"{k:>20}" for k in keys))
    med = {a: {k: statistics.median(v) for k, v in r.items()} for a, r in results.items()}
    for arm, r in med.items():
        print(f"{arm:24}" + "".join(f"{r[k]:20.2f}" for k in keys))
    print(json.dumps(med))


if __name__ == "__main__":
    main()
