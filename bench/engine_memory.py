r"""Where the CPU engine's resident memory goes, per component, against llama-server.

For each GGUF file (default: the default model), a fresh child process builds an
``EngineCore`` as the engine process does, reading ``VmRSS`` after each stage: the
interpreter, ``import torch``, the engine's own imports, the C++ kernels, then inside
``EngineCore``: the model files, the weights, the KV cache and model runner, the
start-up prefill that sizes the step budget, the grammar manager (the tokenizer for
structured output), then one 64-token prompt with 32 output tokens. Beside the stages:
the bytes of the tensors the process holds by kind (weight blocks, float weights, KV
cache), and what ``malloc_trim`` would still hand back at the end (heap the allocator
kept).

``--llama-server PATH`` starts llama.cpp's server on the same file with the same KV cache
(``-c`` = the engine's KV tokens, float16) and sends it the same request. For both, after
the request: RSS and PSS from ``/proc/PID/smaps``, RSS split into anonymous pages (heap,
tensors, KV cache), shared-library pages and other files' pages (llama-server maps the
GGUF file). Prints a table per file and one JSON line.

    python bench/engine_memory.py [--kv-tokens 4096] [--llama-server PATH] [FILE.gguf ...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


def rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def breakdown(pid: int | str = "self") -> dict[str, float]:
    """A process's resident memory (MB) from ``/proc/PID/smaps``: RSS and PSS, and RSS by
    kind of mapping: anonymous pages (heap, tensors, KV cache, Python objects), pages of
    shared libraries (``*.so*``), pages of other files (a memory-mapped GGUF file)."""
    out = {"rss": 0.0, "pss": 0.0, "anon": 0.0, "libraries": 0.0, "other files": 0.0}
    kind = "anon"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):
            fields = rest.split()
            name = fields[4] if len(fields) > 4 else ""
            lib = ".so" in name.rsplit("/", 1)[-1]
            kind = "anon" if not name.startswith("/") else "libraries" if lib else "other files"
        elif head in ("Rss:", "Pss:"):
            out[head[:-1].lower()] += int(rest.split()[0]) / 1024
        elif head == "Anonymous:":
            out["anon"] += int(rest.split()[0]) / 1024
            if kind != "anon":
                out[kind] -= int(rest.split()[0]) / 1024
        if head == "Rss:" and kind != "anon":
            out[kind] += int(rest.split()[0]) / 1024
    return {k: round(v, 1) for k, v in out.items()}


def show(name: str, mem: dict[str, float]) -> None:
    parts = ", ".join(f"{k} {mem[k]:.1f}" for k in ("anon", "libraries", "other files"))
    print(
        f"  {name:33s} RSS {mem['rss']:6.1f} MB ({parts}), PSS {mem['pss']:6.1f} MB",
        file=sys.stderr,
    )


def child(model: str | None, kv_tokens: int) -> dict[str, Any]:
    """The stages in this process (a fresh one per file): ``[(stage, RSS MB)]`` and the
    tensor bytes by kind."""
    stages: list[tuple[str, float]] = [("python", rss_mb())]
    import torch

    stages.append(("import torch", rss_mb()))
    import structllm.engine.process  # noqa: F401  (what the engine process imports)
    from structllm.engine import core as core_mod

    stages.append(("structllm engine imports", rss_mb()))
    from structllm.kernels import cpu_ext

    cpu_ext.build_all()
    stages.append(("C++ kernels loaded", rss_mb()))
    from structllm.config import EngineConfig
    from structllm.protocol import AddRequest, SamplingParams

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            out = fn(*a, **k)
            stages.append((name, rss_mb()))
            return out

        return wrapper

    # KV bytes per token: K and V, every layer, float16
    cfg = core_mod.prepare_model(model).config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    core_cls = core_mod.EngineCore
    core_mod.prepare_model = timed("model files (config, tokenizer)", core_mod.prepare_model)
    core_cls._load = timed("weights", core_cls._load)  # type: ignore[method-assign]
    core_cls._make_runner = timed("KV cache + model runner", core_cls._make_runner)  # type: ignore[method-assign]
    core_cls._token_budget = timed("start-up prefill (step budget)", core_cls._token_budget)  # type: ignore[method-assign]
    core_mod.GrammarManager = timed("grammar manager", core_mod.GrammarManager)  # type: ignore[misc]
    kwargs: dict[str, Any] = {"kv_cache_memory": kv_tokens * per_token, "kv_cache_dtype": "float16"}
    if model:
        kwargs["model"] = model
    core = core_cls(EngineConfig(**kwargs))
    stages.append(("EngineCore ready", rss_mb()))
    sp = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0)
    core.add_request(AddRequest("r", list(range(100, 164)), sp))
    while core.has_work:
        core.step()
    stages.append(("after a 64 + 32 token request", rss_mb()))
    memory = breakdown()
    kinds: dict[str, int] = {}
    seen: set[int] = set()
    kv = {t.untyped_storage().data_ptr() for pair in core.runner.kv_caches for t in pair}  # type: ignore[union-attr]
    import gc

    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            st = o.untyped_storage()
            if st.data_ptr() in seen or st.nbytes() == 0:
                continue
            seen.add(st.data_ptr())
            kind = (
                "KV cache"
                if st.data_ptr() in kv
                else "weight blocks (uint8)"
                if o.dtype == torch.uint8
                else f"other tensors ({str(o.dtype).removeprefix('torch.')})"
            )
            kinds[kind] = kinds.get(kind, 0) + st.nbytes()
    before = rss_mb()
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    core.close()
    return {
        "model": core.files.name,
        "stages": stages,
        "tensors_mb": {k: round(v / 2**20, 1) for k, v in sorted(kinds.items())},
        "malloc_trim_frees_mb": round(before - rss_mb(), 1),
        "memory_mb": memory,
        "kv_tokens": kv_tokens,
    }


def llama_memory(server: str, model: str, kv_tokens: int) -> dict[str, float]:
    """llama-server's memory (``breakdown``) on ``model`` with ``kv_tokens`` of float16 KV
    cache, after the same request."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [server, "-m", model, "--port", str(port), "--host", "127.0.0.1", "-np", "1"]
    cmd += ["-c", str(kv_tokens), "-t", str(os.cpu_count() or 1), "--log-disable"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        body = {"prompt": list(range(100, 164)), "n_predict": 32, "ignore_eos": True}
        req = urllib.request.Request(
            f"{base}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
        return breakdown(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("models", nargs="*", help="GGUF files (default: the default model)")
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child or None, a.kv_tokens)))
        return 0
    results = []
    for model in a.models or [""]:
        out = subprocess.run(
            [sys.executable, __file__, "--child", model, "--kv-tokens", str(a.kv_tokens)],
            check=True,
            capture_output=True,
            text=True,
        )
        res = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{res['model']}: {a.kv_tokens}-token float16 KV cache", file=sys.stderr)
        last = 0.0
        for name, mb in res["stages"]:
            print(f"  {name:34s} {mb:7.1f} MB  (+{mb - last:6.1f})", file=sys.stderr)
            last = mb
        for kind, mb in res["tensors_mb"].items():
            print(f"  tensors: {kind:25s} {mb:7.1f} MB", file=sys.stderr)
        print(
            f"  malloc_trim would still free     {res['malloc_trim_frees_mb']:7.1f} MB",
            file=sys.stderr,
        )
        show("structllm engine", res["memory_mb"])
        if a.llama_server:
            from structllm.model.loader import prepare_model

            path = model or str(prepare_model(None).source)
            llama = llama_memory(a.llama_server, path, a.kv_tokens)
            res["llama_server_memory_mb"] = llama
            res["llama_server_rss_mb"] = llama["rss"]
            res["ratio"] = round(res["memory_mb"]["rss"] / llama["rss"], 2)
            res["pss_ratio"] = round(res["memory_mb"]["pss"] / llama["pss"], 2)
            show("llama-server, same file and KV", llama)
            print(
                f"  structllm / llama-server: RSS {res['ratio']:.2f}x, PSS {res['pss_ratio']:.2f}x",
                file=sys.stderr,
            )
        results.append(res)
    print(json.dumps({"bench": "engine_memory", "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
