r"""LoRA adapters' cost to decoding throughput, offline, in one process.

    python bench/lora.py [FILE.gguf] [--requests 16] [--tokens 48] [--rounds 3] [--rank 16]
                         [--lora-dtype auto] [--lora-dtype float16 ...]

Four arms on the same model (default: the default model), ``--requests`` concurrent
greedy requests of ``--tokens`` output tokens each, output tokens/s:

- ``off``: an engine without ``enable_lora``;
- ``unused``: ``enable_lora=True``, no request names an adapter (the bar: >= 0.98x off);
- ``one``: every request with the same rank-``--rank`` adapter (>= 0.90x);
- ``distinct``: each request its own adapter (``max_loras`` = requests; >= 0.60x).

``--llama-server BIN`` adds the single-stream comparison: the first adapter written
again as a llama.cpp GGUF LoRA file (``general.type = adapter``, ``.lora_a`` /
``.lora_b``, F32, as ``convert_lora_to_gguf.py`` writes them), one greedy request at a
time of ``--single-tokens`` tokens, ``--single-rounds`` times each, alternating:
structllm offline with the file as its ``LoRARequest`` against ``llama-server -m MODEL
--lora FILE`` (one slot, all cores, its ``/completion`` endpoint; the HTTP round trip is
in its figure, a few ms of seconds). The bar: structllm >= 1.0x llama-server.

``--lora-dtype`` (repeatable) runs ``one`` and ``distinct`` once per adapter storage
type, each on its own engine (``one@float16``, ...); ``unused`` on the first's. The
default, ``auto``, stores them in float16 over a GGUF base (``formats.resolve_lora_dtype``);
``--lora-dtype auto --lora-dtype float32`` shows what float32 storage would cost.

The adapters are random PEFT directories written for the model's shapes (every
projection, B scaled small so the text stays the model's kind of text). Speculative
decoding is off in every arm (each arm's outputs differ, so their drafts would too).
Rounds interleave the arms (off, unused, one, distinct, ...) so that they see the same
load; per arm the best round. The figures are wall time: a loaded machine makes them
noisy, the ratios less so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
import time
from collections.abc import Iterator
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


def write_gguf_adapter(out: Path, peft_dir: Path, arch: str) -> Path:
    """The PEFT adapter ``peft_dir`` as a GGUF LoRA file, as llama.cpp's converter names
    and shapes its tensors (rows left in the file's order: a bench of speed only)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    from structllm.lora import GGUF_MODULES

    names = {v: k for k, v in GGUF_MODULES.items()}
    w = gguf.GGUFWriter(str(out), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(cfg["lora_alpha"]))
    key = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight")
    for name, t in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        m = key.fullmatch(name)
        assert m is not None, name
        # numpy [r, in] and [out, r]: GGUF's ne reversed, as the converter writes them
        w.add_tensor(f"blk.{m[1]}.{names[m[2]]}.weight.lora_{m[3].lower()}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@contextlib.contextmanager
def llama_server(binary: str, model: Path, lora: Path) -> Iterator[str]:
    """``llama-server -m model --lora lora`` (one slot, all cores) running; its URL."""
    import os

    from llama_server import LlamaServer

    flags = ["--lora", str(lora), "-np", "1", "-c", "4096"]
    with LlamaServer(binary, model, flags, threads=os.cpu_count() or 1, timeout=120) as server:
        yield server.url


def llama_rate(url: str, prompt: str, n: int) -> float:
    """Output tokens/s of one greedy ``/completion`` of ``n`` tokens (its wall time)."""
    import urllib.request

    body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True}
    body["cache_prompt"] = False
    req = urllib.request.Request(
        url + "/completion", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return int(out.get("tokens_predicted", 0)) / (time.perf_counter() - t)


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
    ap.add_argument("--llama-server", help="llama-server binary: the single-stream comparison")
    ap.add_argument("--single-tokens", type=int, default=128)
    ap.add_argument("--single-rounds", type=int, default=3)
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
        single = single_stream(a, first, paths[0], cfg) if a.llama_server else {}
    import os

    print(f"load average {os.getloadavg()[0]:.1f}; {a.requests} requests x {a.tokens} tokens")
    for name, rate in best.items():
        print(f"{name:>18}: {rate:7.1f} tok/s  {rate / best['off']:.2f}x off")
    if single:
        ours, theirs = single["structllm"], single["llama-server"]
        print(f"single stream, one GGUF LoRA, {a.single_tokens} tokens:")
        print(f"{'structllm':>18}: {ours:7.1f} tok/s  {ours / theirs:.2f}x llama-server")
        print(f"{'llama-server':>18}: {theirs:7.1f} tok/s")


def single_stream(a: Any, llm: Any, peft_dir: Path, cfg: Any) -> dict[str, float]:
    """Best-of-rounds tokens/s of one greedy request with the first adapter as a GGUF
    LoRA file: structllm offline and llama-server, alternating."""
    from structllm import LoRARequest, SamplingParams
    from structllm.model.loader import prepare_model

    model = prepare_model(a.model).source
    assert model is not None and str(model).endswith(".gguf"), "llama-server needs a GGUF model"
    lora = write_gguf_adapter(peft_dir.parent / "single.lora.gguf", peft_dir, cfg.architecture)
    req = LoRARequest("single", 1000, str(lora))
    prompt = "Tell me a long story about a lighthouse keeper."
    params = SamplingParams(temperature=0, max_tokens=a.single_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), lora_request=req)
    best = {"structllm": 0.0, "llama-server": 0.0}
    with llama_server(a.llama_server, Path(model), lora) as url:
        llama_rate(url, prompt, 2)  # warm up
        for _ in range(a.single_rounds):
            t0 = time.perf_counter()
            out = llm.generate([prompt], params, lora_request=req)[0]
            rate = len(out.token_ids) / (time.perf_counter() - t0)
            best["structllm"] = max(best["structllm"], rate)
            rate = llama_rate(url, prompt, a.single_tokens)
            best["llama-server"] = max(best["llama-server"], rate)
    return best


if __name__ == "__main__":
    main()
