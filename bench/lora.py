r"""LoRA adapters' cost to decoding throughput, offline, in one process.

    python bench/lora.py [FILE.gguf] [--requests 16] [--tokens 48] [--rounds 3] [--rank 16]
                         [--lora-dtype auto] [--lora-dtype float16 ...]

Four arms on the same model (default: the default model), ``--requests`` concurrent
greedy requests of ``--tokens`` output tokens each, output tokens/s:

- ``off``: an engine without ``enable_lora``;
- ``unused``: ``enable_lora=True``, no request names an adapter (the bar: >= 0.98x off);
- ``one``: every request with the same rank-``--rank`` adapter (>= 0.90x);
- ``distinct``: each request its own adapter (``max_loras`` = requests; >= 0.60x).

``--lora-dtype`` (repeatable) runs ``one`` and ``distinct`` once per adapter storage
type, each on its own engine (``one@float16``, ...); ``unused`` on the first's.

The adapters are random PEFT directories written for the model's shapes (every
projection, B scaled small so the text stays the model's kind of text). Speculative
decoding is off in every arm (each arm's outputs differ, so their drafts would too).
Rounds interleave the arms (off, unused, one, distinct, ...) so that they see the same
load; per arm the best round. The figures are wall time: a loaded machine makes them
noisy, the ratios less so.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, cfg: Any, rank: int, seed: int) -> Path:
    """A random PEFT adapter of every projection of ``cfg``'s layers."""
    import torch
    from safetensors.torch import save_file

    from structllm.lora import module_shape

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for m in MODULES:
            module = ("self_attn." if m[0] in "qkvo" else "mlp.") + m
            n, k = module_shape(cfg, module)
            key = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=g) / k**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": MODULES}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument(
        "--lora-dtype", action="append", choices=["auto", "float32", "float16", "bfloat16"]
    )
    a = ap.parse_args()
    dtypes: list[str] = a.lora_dtype or ["auto"]

    from structllm import LLM, LoRARequest, SamplingParams

    common: dict[str, Any] = {"speculative_config": {"method": "none"}, "max_num_seqs": 32}
    off = LLM(a.model, **common)
    loras = {
        dtype: LLM(
            a.model,
            enable_lora=True,
            max_loras=a.requests,
            max_cpu_loras=a.requests,
            max_lora_rank=a.rank,
            lora_dtype=dtype,
            **common,
        )
        for dtype in dtypes
    }
    first = loras[dtypes[0]]
    cfg = first.engine.files.config
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    prompts = [f"Tell me about the number {i}." for i in range(a.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_adapter(Path(tmp) / f"a{i}", cfg, a.rank, i) for i in range(a.requests)]
        reqs = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        arms: dict[str, tuple[Any, Any]] = {"off": (off, None), "unused": (first, None)}
        for dtype, llm in loras.items():
            tag = f"@{dtype}" if len(loras) > 1 else ""
            arms[f"one{tag}"] = (llm, reqs[0])
            arms[f"distinct{tag}"] = (llm, reqs)
        for llm, r in arms.values():  # warm up: kernels built, adapters loaded
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), lora_request=r)
        best: dict[str, float] = {}
        for _ in range(a.rounds):
            for name, (llm, r) in arms.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, lora_request=r)
                rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
                best[name] = max(best.get(name, 0.0), rate)
    import os

    print(f"load average {os.getloadavg()[0]:.1f}; {a.requests} requests x {a.tokens} tokens")
    for name, rate in best.items():
        print(f"{name:>18}: {rate:7.1f} tok/s  {rate / best['off']:.2f}x off")


if __name__ == "__main__":
    main()
