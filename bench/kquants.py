r"""The k-quant figure matrix against llama-server, the same files in the same run.

For each GGUF file (default: the default model requantised by llama.cpp's own
``llama-quantize`` to Q4_K_M, Q5_K_M, Q6_K and Q8_0, cached by
``tests/support/llamacpp.py``), ``structllm run`` and ``llama-server`` are started on it
side by side (both with ``--kv-tokens`` of float16 KV cache; llama-server with one unified
KV buffer for its 16 slots, so that one 8192-token prompt fits, and all cores) and every
workload runs on one, then the other, alternating (A/B, then B/A), each repetition with fresh
prompts so that neither prefix cache helps:

- single stream: one request, 64-token prompt, 64 output tokens: the median
  inter-token latency (ITL) and time to first token;
- concurrency 16: 16 requests at once, 128-token prompts, 64 output tokens: output
  tokens/s;
- long prompts: time to first token of one 512-, 2048- and 8190-token prompt (2 output
  tokens: 8190 + 2 fill the default model's 8192-token context), and the 2048-token
  prompt's tokens/s.

structllm runs without speculative decoding (its default on these files), as
llama-server does, unless ``--speculative``; inter-token latency counts a chunk of n
tokens as n tokens (``bench/serve.py``).

Then both engines' resident memory (structllm's engine process, llama-server). The
machine's load average is printed beside each file's figures: on a shared machine they
are noisy, the ratios (same run, interleaved) less so. Prints a table and one JSON line.

    python bench/kquants.py --llama-server PATH [--reps 3] [FILE.gguf ...]
    STRUCTLLM_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/kquants.py \
        --llama-server AVX2-BUILD/llama-server        # the AVX2 build of both
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve.py, beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

import serve
from llama_server import LlamaServer

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
LONG = (512, 2048, 8190)  # 8190 + 2 output tokens: the default model's 8192 context


def default_files() -> list[Path]:
    """The default model requantised by llama-quantize to each of ``TYPES`` (cached)."""
    from structllm.model.files import default_model_path
    from tests.support import llamacpp

    d = llamacpp.root() / "gguf"
    d.mkdir(parents=True, exist_ok=True)
    link = d / default_model_path().name
    if not link.exists():
        link.symlink_to(default_model_path())
    return [llamacpp.quantize(link, t, "--allow-requantize") for t in TYPES]


def start_both(path: Path, a: argparse.Namespace) -> tuple[dict[str, tuple[Any, str]], LlamaServer]:
    """structllm and llama-server on ``path``, both healthy: ``{name: (process, URL)}``
    and the ``LlamaServer`` (to stop)."""
    # plain decoding on both sides unless --speculative: llama-server drafts nothing by
    # default, and the comparison is of the kernels (random prompts make this small
    # model repeat itself, where n-gram drafts halve structllm's per-token latency)
    spec = [] if a.speculative else ["--speculative-config", '{"method": "none"}']
    common = dict(max_concurrency=16, kv_tokens=a.kv_tokens, server_args=[str(path), *spec])
    ours = serve.launch(argparse.Namespace(**common))
    flags = ["-np", "16", "-kvu", "-c", str(a.kv_tokens), "--log-disable"]
    llama = LlamaServer(a.llama_server, path, flags, threads=os.cpu_count() or 1)
    try:
        llama.start().wait_healthy()
    except BaseException:
        ours[0].send_signal(signal.SIGTERM)
        ours[0].wait(timeout=60)
        raise
    assert llama.proc is not None
    return {"structllm": ours, "llama.cpp": (llama.proc, llama.url)}, llama


def run(url: str, items: list[Any], out_len: int, concurrency: int) -> list[serve.Result]:
    results, elapsed = anyio.run(
        serve.run_load, url, None, items, out_len, float("inf"), concurrency, None, 0
    )
    bad = next((r.error for r in results if not r.ok), None)
    if bad:
        raise SystemExit(f"{url}: a request failed: {bad}")
    results[0].e2e = max(results[0].e2e, elapsed)  # (the c16 figure uses the wall time)
    return results


def measure(
    servers: dict[str, tuple[Any, str]], reps: int, seed: int, long: list[int]
) -> dict[str, Any]:
    """Every workload on each server in turn; per server the medians over ``reps``."""
    got: dict[str, dict[str, list[float]]] = {name: {} for name in servers}

    def add(name: str, key: str, value: float) -> None:
        got[name].setdefault(key, []).append(value)

    for _, url in servers.values():  # warm-up, not measured
        run(url, serve.prompts(2, 16, 49152, seed - 1, False), 4, 2)
    names = list(servers)
    for rep in range(reps):
        # the order rotates: llama-server's threads spin on for a while after its last
        # request, slowing whichever arm runs next, so neither may always be that arm
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            url = servers[name][1]
            s = seed + 100 * rep
            one = run(url, serve.prompts(1, 64, 49152, s, False), 64, 1)[0]
            add(name, "itl_ms", 1000 * statistics.median(one.itls))
            add(name, "ttft_ms", 1000 * one.ttft)
            c16 = run(url, serve.prompts(16, 128, 49152, s + 1, False), 64, 16)
            add(name, "c16_tok_s", sum(r.output_tokens for r in c16) / c16[0].e2e)
            for n in long:
                if n == max(LONG) and rep > 0:
                    continue  # one longest prompt each (seconds on 2 cores)
                r = run(url, serve.prompts(1, n, 49152, s + n, False), 2, 1)[0]
                add(name, f"ttft_{n}_ms", 1000 * r.ttft)
    out: dict[str, Any] = {}
    for name, figs in got.items():
        med = {k: round(statistics.median(v), 1) for k, v in figs.items()}
        if "ttft_2048_ms" in med:
            med["prompt_2048_tok_s"] = round(2048 / (med["ttft_2048_ms"] / 1000), 1)
        out[name] = med
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("files", nargs="*", help="GGUF files (default: the four requantised)")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--speculative",
        action="store_true",
        help="keep structllm's default speculative decoding (off here by default)",
    )
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument(
        "--long",
        default=",".join(map(str, LONG)),
        help="the long prompts' lengths (a loaded machine: leave out 8190; '': none)",
    )
    a = ap.parse_args()
    # SIGTERM (timeout, kill) runs the ``finally`` below: no server outlives the run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    files = [Path(f) for f in a.files] or default_files()
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    isa = os.environ.get("STRUCTLLM_CPU_ISA", "native")
    print(
        f"# {cpu}, {os.cpu_count()} cores, structllm ISA {isa}, {a.llama_server}", file=sys.stderr
    )
    rows = []
    for path in files:
        load0 = Path("/proc/loadavg").read_text().split()[0]
        servers, llama = start_both(path, a)
        try:
            figs = measure(servers, a.reps, a.seed, [int(n) for n in a.long.split(",") if n])
            engine = serve.engine_pid(servers["structllm"][0].pid)
            figs["structllm"]["rss_mb"] = round(serve.rss_mb(engine), 1) if engine else None
            figs["llama.cpp"]["rss_mb"] = round(serve.rss_mb(servers["llama.cpp"][0].pid), 1)
        finally:
            servers["structllm"][0].send_signal(signal.SIGTERM)
            llama.stop()
            servers["structllm"][0].wait(timeout=60)
        load1 = Path("/proc/loadavg").read_text().split()[0]
        ours, theirs = figs["structllm"], figs["llama.cpp"]
        ratio = {k: round(ours[k] / theirs[k], 2) for k in ours if ours[k] and theirs.get(k)}
        rows.append(
            {"file": path.name, "load": [load0, load1], **figs, "structllm / llama.cpp": ratio}
        )
        print(f"{path.name}  (load average {load0} -> {load1})", file=sys.stderr)
        for k in ours:
            print(
                f"  {k:18s} structllm {ours[k]:9.1f}  llama.cpp {theirs[k]:9.1f}  "
                f"ratio {ratio.get(k, float('nan')):5.2f}",
                file=sys.stderr,
            )
    print(json.dumps({"bench": "kquants", "cpu": cpu, "isa": isa, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
