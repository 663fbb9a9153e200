r"""Where the CPU engine's resident memory goes, per component, against llama-server.

For each GGUF file (default: the default model), a fresh child process builds an
``EngineCore`` as the engine process does, reading ``VmRSS`` after each stage: the
interpreter, ``import torch``, the engine's own imports, the C++ kernels, then inside
``EngineCore``: the model files, the weights, the KV cache and model runner, the
start-up prefill that sizes the step budget, the grammar manager (the tokenizer for
structured output), then one 64-token prompt with 32 output tokens, then idle (the heap
the steps kept handed back, as the engine loop does after a second without requests).
Beside the stages: the bytes of the tensors the process holds by kind (weight blocks,
float weights, KV cache).

``--llama-server PATH`` starts llama.cpp's server on the same file with the same KV cache
(``-c`` = the engine's KV tokens, float16) and sends it the same request. For both, after
the request: RSS and PSS from ``/proc/PID/smaps``, in all and by kind of mapping (the brk
heap, anonymous mappings such as Python's object arenas, the copied-on-write pages of
shared libraries, the libraries' file pages, other files' pages: llama-server maps the
GGUF file). Three bare interpreters (nothing; ``libtorch_cpu.so`` alone; ``import
torch``) give what torch costs before any structllm code, and the engine's anonymous
memory is accounted as its tensors + torch's share + the rest. Prints a table per file
and one JSON line.

    python bench/engine_memory.py [--kv-tokens 4096] [--llama-server PATH] [FILE.gguf ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any


def rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


KINDS = ("heap", "anon mappings", "library relocations", "libraries", "other files")


def breakdown(pid: int | str = "self") -> dict[str, float]:
    """A process's resident memory (MB) from ``/proc/PID/smaps``: RSS, PSS and anonymous
    pages in all, and RSS and PSS by kind of mapping (``KINDS``): the brk heap (glibc's
    main arena: tensors under the mmap threshold, C++ objects, Python objects over 512
    bytes), anonymous mappings (Python's 1 MiB object arenas, thread stacks and arenas,
    large allocations), the copied-on-write pages of shared libraries (``*.so*``: the
    relocated ``.data.rel.ro``, GOT and ``.data`` the loader wrote), the libraries' clean
    file pages (code and constants), pages of other files (a memory-mapped GGUF file)."""
    out = {"rss": 0.0, "pss": 0.0, "anon": 0.0}
    for kind in KINDS:
        out[kind] = out[f"{kind} pss"] = 0.0
    name = ""
    fields: dict[str, float] = {}

    def close() -> None:
        if not fields:
            return
        lib = name.startswith("/") and ".so" in name.rsplit("/", 1)[-1]
        rss, pss, anon = fields.get("Rss", 0), fields.get("Pss", 0), fields.get("Anonymous", 0)
        out["rss"] += rss
        out["pss"] += pss
        out["anon"] += anon
        if name == "[heap]" or not name.startswith("/"):
            kind = "heap" if name == "[heap]" else "anon mappings"
            out[kind] += rss
            out[f"{kind} pss"] += pss
            return
        # a file mapping: its anonymous pages are private copies, the rest the file's
        kind = "libraries" if lib else "other files"
        share = pss * anon / rss if rss else 0.0  # (anonymous pages are never shared)
        out[kind] += rss - anon
        out[f"{kind} pss"] += pss - share
        if lib:
            out["library relocations"] += anon
            out["library relocations pss"] += share
        else:
            out["anon mappings"] += anon
            out["anon mappings pss"] += share

    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):
            close()
            parts = rest.split()
            name = parts[4] if len(parts) > 4 else ""
            fields = {}
        elif head in ("Rss:", "Pss:", "Anonymous:"):
            fields[head[:-1]] = int(rest.split()[0]) / 1024
    close()
    return {k: round(v, 1) for k, v in out.items()}


def python_arenas() -> dict[str, float]:
    """pymalloc's object arenas in this process (MB): mapped, and the bytes of live
    objects in them (``sys._debugmallocstats``, which writes to file descriptor 2)."""
    import tempfile

    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode()
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.startswith("# arenas allocated current"):
            out["arenas"] = float(int(value.replace(",", "")))  # 1 MiB each
        elif key.startswith("# bytes in allocated blocks"):
            out["objects"] = round(int(value.replace(",", "")) / 2**20, 1)
    return out


def show(name: str, mem: dict[str, float]) -> None:
    parts = ", ".join(f"{k} {mem[k]:.1f}" for k in KINDS)
    print(
        f"  {name:33s} RSS {mem['rss']:6.1f} MB, PSS {mem['pss']:6.1f} MB, "
        f"anonymous {mem['anon']:6.1f} MB; RSS by kind: {parts}",
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
    arenas = python_arenas()
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
    core.release_idle_memory()  # what the engine loop does after a second without requests
    stages.append(("idle (release_idle_memory)", rss_mb()))
    idle = breakdown()
    core.close()
    return {
        "model": core.files.name,
        "stages": stages,
        "tensors_mb": {k: round(v / 2**20, 1) for k, v in sorted(kinds.items())},
        "malloc_trim_frees_mb": round(before - rss_mb(), 1),
        "memory_mb": memory,
        "idle_memory_mb": idle,
        "python_arenas_mb": arenas,
        "kv_tokens": kv_tokens,
    }


def torch_alone(what: str) -> dict[str, Any]:
    """What torch costs a process before any structllm code (this process, a fresh one):
    ``python``: nothing; ``libtorch_cpu``: only ``libtorch_cpu.so`` loaded (its static
    initialisers build the C++ operator registry); ``torch``: ``import torch``."""
    if what == "libtorch_cpu":
        import ctypes
        import importlib.util

        spec = importlib.util.find_spec("torch")
        assert spec is not None and spec.origin is not None
        lib = Path(spec.origin).parent / "lib"
        for name in ("libc10.so", "libtorch_cpu.so"):
            ctypes.CDLL(str(lib / name), mode=ctypes.RTLD_GLOBAL)
    elif what == "torch":
        import torch  # noqa: F401
    return {"memory_mb": breakdown(), "python_arenas_mb": python_arenas()}


def accounting(res: dict[str, Any], base: dict[str, Any], cpu: dict[str, Any], py: Any) -> None:
    """Print where the engine's anonymous memory goes: its tensors, what ``import torch``
    leaves in a bare interpreter (split into libtorch_cpu's static initialisers, the rest
    of the brk heap, Python's arenas, library relocations), and the rest."""
    mem, tmem, cmem, pmem = res["memory_mb"], base["memory_mb"], cpu["memory_mb"], py["memory_mb"]
    tensors = sum(res["tensors_mb"].values())
    t_heap = tmem["heap"] - pmem["heap"]
    static = cmem["heap"] - pmem["heap"]
    t_arenas = base["python_arenas_mb"]["arenas"] - py["python_arenas_mb"]["arenas"]
    t_reloc = tmem["library relocations"] - pmem["library relocations"]
    t_anon = tmem["anon"] - pmem["anon"]
    rows = [
        ("tensors (weights, KV cache, other)", tensors),
        ("python + this script's imports (json, urllib)", pmem["anon"]),
        ("import torch: libtorch_cpu static init", static),
        ("import torch: rest of the brk heap", t_heap - static),
        ("import torch: Python object arenas", t_arenas),
        ("import torch: library relocations", t_reloc),
        ("import torch: other anonymous", t_anon - t_heap - t_arenas - t_reloc),
        ("the rest (structllm, gguf, step heap)", mem["anon"] - tensors - tmem["anon"]),
    ]
    print(f"  anonymous {mem['anon']:.1f} MB =", file=sys.stderr)
    for name, mb in rows:
        print(f"    {name:40s} {mb:7.1f} MB", file=sys.stderr)
    arenas = res["python_arenas_mb"]
    print(
        f"    (Python arenas in the engine: {arenas['arenas']:.0f} MB holding "
        f"{arenas['objects']:.1f} MB of live objects)",
        file=sys.stderr,
    )
    res["accounting_mb"] = {name: round(mb, 1) for name, mb in rows}


def llama_memory(server: str, model: str, kv_tokens: int) -> dict[str, float]:
    """llama-server's memory (``breakdown``) on ``model`` with ``kv_tokens`` of float16 KV
    cache, after the same request."""
    from llama_server import LlamaServer

    flags = ["-np", "1", "-c", str(kv_tokens), "-t", str(os.cpu_count() or 1), "--log-disable"]
    with LlamaServer(server, model, flags) as llama:
        body = {"prompt": list(range(100, 164)), "n_predict": 32, "ignore_eos": True}
        req = urllib.request.Request(
            f"{llama.url}/completion",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
        return breakdown(llama.pid)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("models", nargs="*", help="GGUF files (default: the default model)")
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--alone", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child or None, a.kv_tokens)))
        return 0
    if a.alone is not None:
        print(json.dumps(torch_alone(a.alone)))
        return 0

    def alone(what: str) -> dict[str, Any]:
        cmd = [sys.executable, __file__, "--alone", what]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    bare = {what: alone(what) for what in ("python", "libtorch_cpu", "torch")}
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
            f"  the steps' heap, handed back idle {res['malloc_trim_frees_mb']:7.1f} MB",
            file=sys.stderr,
        )
        show("structllm engine", res["memory_mb"])
        show("structllm engine, idle", res["idle_memory_mb"])
        show("import torch alone", bare["torch"]["memory_mb"])
        accounting(res, bare["torch"], bare["libtorch_cpu"], bare["python"])
        if a.llama_server:
            from structllm.model.loader import prepare_model

            path = model or str(prepare_model(None).source)
            llama = llama_memory(a.llama_server, path, a.kv_tokens)
            res["llama_server_memory_mb"] = llama
            res["llama_server_rss_mb"] = llama["rss"]
            res["ratio"] = round(res["memory_mb"]["rss"] / llama["rss"], 2)
            res["pss_ratio"] = round(res["memory_mb"]["pss"] / llama["pss"], 2)
            res["idle_ratio"] = round(res["idle_memory_mb"]["rss"] / llama["rss"], 2)
            show("llama-server, same file and KV", llama)
            print(
                f"  structllm / llama-server: RSS {res['ratio']:.2f}x, PSS {res['pss_ratio']:.2f}x"
                f" (idle: RSS {res['idle_ratio']:.2f}x)",
                file=sys.stderr,
            )
        results.append(res)
    print(json.dumps({"bench": "engine_memory", "torch_alone": bare, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
