r"""Serving benchmark for any OpenAI-compatible server (like ``vllm bench serve``).

    # against a running server
    python bench/serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 16
    # start `structllm run` for the run, and compare with the offline engine in the same run
    python bench/serve.py --launch --compare-offline

Fixed-seed synthetic prompts of ``--input-len`` random token ids (sent as token-id
prompts to /v1/completions, which vLLM and structllm accept; ``--text-prompts`` sends
random words instead, for servers that only take text), ``--output-len`` tokens each with
EOS ignored, streaming. Arrivals: all at once, or Poisson at ``--request-rate``;
``--max-concurrency`` caps requests in flight. Prints TTFT, inter-token latency (a
chunk of n tokens after a gap g counts as n tokens g / n apart, as in
``bench/speculative.py``; n from each chunk's usage, ``continuous_usage_stats``, where
the server gives it, else one token a chunk) and end-to-end latency (p50/p90/p99),
output tokens/s and requests/s as a table and one JSON line. ``--compare-offline``
also runs structllm's offline engine (in this process, after the server is gone) on the
same prompts with ``max_num_seqs`` = the concurrency, and prints serving throughput as a
fraction of it.

``--llama-server PATH`` runs the same workload, in the same run, against llama.cpp's
``llama-server`` started on the same GGUF file (``--llama-model``, default: structllm's
default model), with ``--max-concurrency`` slots and all cores, and prints both side by
side with structllm's ratios; both servers' resident memory is reported after the load
(structllm's engine process: ``engine_rss_mb``). ``--kv-tokens N`` gives both the same
KV cache (llama-server ``-c N``; structllm N float16 tokens of the model given first in
``--server-args``), for memory comparisons. Another GGUF file (a k-quant one):

    python bench/serve.py --launch --llama-server ~/llama-server --llama-model F.gguf \
        --num-prompts 3 --max-concurrency 1 --input-len 2048 --output-len 4 \
        --kv-tokens 4096 --server-args F.gguf

    # the issue's two workloads
    python bench/serve.py --launch --llama-server ~/llama-server \
        --num-prompts 8 --max-concurrency 1
    python bench/serve.py --launch --llama-server ~/llama-server \
        --num-prompts 64 --max-concurrency 16

``--storm 16`` adds the short-steps probe after the load: time to first token of an
8-token request on the idle server and right after 16 streams that the client closed
3 s after sending, back to back, ``--storm-reps`` times (medians and their ratio).

    python bench/serve.py --launch --storm 16 --skip-load

``--responses`` adds the Responses workload (``bench/responses.py``): its overhead over
chat completions on the same prompts, a chained turn's time to first token against the
full history, and the response store's write/read p99 under that load.

    python bench/serve.py --launch --responses --skip-load --num-prompts 64 \
        --max-concurrency 16 --server-args --responses-store /tmp/bench-responses.sqlite3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from llama_server import LlamaServer

WORDS = [
    "time",
    "person",
    "year",
    "way",
    "day",
    "thing",
    "man",
    "world",
    "life",
    "hand",
    "part",
    "child",
    "eye",
    "woman",
    "place",
    "work",
    "week",
    "case",
    "point",
    "government",
    "company",
    "number",
    "group",
    "problem",
    "fact",
]


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    error: str = ""


def prompts(n: int, length: int, vocab: int, seed: int, text: bool) -> list[Any]:
    rng = random.Random(seed)
    if text:
        return [" ".join(rng.choice(WORDS) for _ in range(length)) for _ in range(n)]
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


async def one(
    client: httpx.AsyncClient,
    url: str,
    model: str | None,
    prompt: Any,
    out_len: int,
    headers: dict[str, str],
    extra: dict[str, Any] | None = None,
) -> Result:
    """One streamed completion, timed; ``extra``: more body fields (e.g. ``priority``)."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": out_len,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        # every chunk's usage so far (vLLM's continuous_usage_stats; servers without it
        # send one token a chunk), so a chunk of several tokens is counted as such
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **(extra or {}),
    }
    if model:
        body["model"] = model
    # A keep-alive connection the server has closed meanwhile fails before any response
    # (llama-server closes each connection after a few requests); httpx does not retry a
    # POST, so the request is sent once more on a fresh connection, timed from then.
    for attempt in range(2):
        r = Result()
        answered = False
        t0 = time.perf_counter()
        last = t0
        chunks = 0
        try:
            async with client.stream(
                "POST", url + "/v1/completions", json=body, headers=headers
            ) as resp:
                answered = True
                if resp.status_code != 200:
                    r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                    return r
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    seen = r.output_tokens
                    if data.get("usage"):
                        r.output_tokens = data["usage"]["completion_tokens"]
                    if any(c.get("text") for c in data.get("choices", [])):
                        now = time.perf_counter()
                        # a chunk of n tokens after a gap g: n tokens g / n apart (vLLM's
                        # bench for multi-token chunks, as with speculative decoding)
                        n = max(1, r.output_tokens - seen) if data.get("usage") else 1
                        if chunks == 0:
                            r.ttft = now - t0
                        else:
                            r.itls += [(now - last) / n] * n
                        last = now
                        chunks += 1
            r.e2e = time.perf_counter() - t0
            r.output_tokens = r.output_tokens or chunks
            r.ok = True
        except httpx.RemoteProtocolError as e:
            r.error = repr(e)
            if attempt == 0 and not answered:
                continue
        except (httpx.HTTPError, OSError) as e:
            r.error = repr(e)
        return r
    return r


async def run_load(
    url: str,
    model: str | None,
    items: list[Any],
    out_len: int,
    rate: float,
    concurrency: int,
    api_key: str | None,
    seed: int,
) -> tuple[list[Result], float]:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[Result] = []
    limiter = anyio.CapacityLimiter(concurrency)
    rng = random.Random(seed)
    limits = httpx.Limits(
        max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=limits) as client:

        async def task(p: Any) -> None:
            async with limiter:
                results.append(await one(client, url, model, p, out_len, headers))

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for p in items:
                tg.start_soon(task, p)
                if math.isfinite(rate):
                    await anyio.sleep(rng.expovariate(rate))
        elapsed = time.perf_counter() - t0
    return results, elapsed


async def storm_probe(
    url: str,
    model: str | None,
    storms: list[list[Any]],
    fresh: list[Any],
    close_after: float,
    api_key: str | None,
) -> dict[str, Any]:
    """Per storm: the time to first token of an 8-token request on the idle server, then
    the storm (its streams sent at once, each closed by the client ``close_after``
    seconds after sending, before or during its prefill), then one more 8-token request
    at once. Medians over the storms; idle and after-storm figures are taken back to
    back, so a change in the machine's load between them counts once, not per run. All
    prompts differ (no prefix-cache hit flatters either figure)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    width = max(len(s) for s in storms) + 8
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    idle: list[Result] = []
    after: list[Result] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=limits) as client:

        async def closed_early(p: Any) -> None:
            with anyio.move_on_after(close_after):  # leaving the stream closes the connection
                await one(client, url, model, p, 4096, headers)

        for k, storm in enumerate(storms):
            idle.append(await one(client, url, model, fresh[2 * k], 8, headers))
            async with anyio.create_task_group() as tg:
                for p in storm:
                    tg.start_soon(closed_early, p)
            after.append(await one(client, url, model, fresh[2 * k + 1], 8, headers))
    bad = next((r.error for r in [*idle, *after] if not r.ok), None)
    if bad:
        raise SystemExit(f"storm probe: a request failed: {bad}")
    idle_ttft = statistics.median(r.ttft for r in idle)
    after_ttft = statistics.median(r.ttft for r in after)
    return {
        "storm_idle_ttft_ms": round(1000 * idle_ttft, 1),
        "storm_after_ttft_ms": round(1000 * after_ttft, 1),
        "storm_ttft_ratio": round(after_ttft / idle_ttft, 2),
        "storm_ratios": [round(a.ttft / i.ttft, 2) for i, a in zip(idle, after, strict=True)],
        "storm_streams": len(storms[0]),
        "storm_close_after_s": close_after,
        "storm_reps": len(storms),
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(results: list[Result], elapsed: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in r.itls]
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": round(elapsed, 2),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "requests_per_s": round(len(ok) / elapsed, 2),
    }
    for name, values in (
        ("ttft_ms", [r.ttft for r in ok]),
        ("itl_ms", itls),
        ("e2e_ms", [r.e2e for r in ok]),
    ):
        for q in (0.5, 0.9, 0.99):
            summary[f"{name}_p{int(q * 100)}"] = round(1000 * pct(values, q), 1)
        summary[f"{name}_mean"] = (
            round(1000 * statistics.fmean(values), 1) if values else float("nan")
        )
    if len(ok) < len(results):
        summary["first_error"] = next(r.error for r in results if not r.ok)
    return summary


def launch(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "structllm",
        "run",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--max-num-seqs",
        str(min(max(args.max_concurrency, 1), 256)),
        *kv_args(args),
        *args.server_args,
    ]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url)
    return proc, url


def div(a: float, b: float) -> float:
    """``a / b`` to 2 places; NaN where b is 0 (every llama.cpp request failed)."""
    return round(a / b, 2) if b else math.nan


def kv_args(args: argparse.Namespace) -> list[str]:
    """``--kv-tokens N``: structllm's KV cache sized to N tokens in float16 (what
    llama-server's ``-c N`` holds), from the served model's shape; else nothing."""
    if not args.kv_tokens:
        return []
    from structllm.model.loader import prepare_model

    model = next((a for a in args.server_args if not a.startswith("-")), None)
    cfg = prepare_model(model).config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, float16
    return ["--kv-cache-memory", str(args.kv_tokens * per_token)]


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start")


def default_gguf() -> str:
    from structllm.model.loader import prepare_model

    source = prepare_model(None).source
    if source is None:
        raise SystemExit("the default model has no GGUF file; give --llama-model")
    return str(source)


def launch_llama(args: argparse.Namespace) -> LlamaServer:
    """llama-server on the same GGUF file, healthy (a ``LlamaServer``: ``stop()`` it): one
    slot per concurrent request, each with room for a prompt and its output, threads =
    all cores (as a user would start it)."""
    slots = max(args.max_concurrency, 1)
    ctx = args.kv_tokens or slots * (args.input_len + args.output_len + 64)
    flags = ["-np", str(slots), "-c", str(ctx), "--log-disable"]
    model = args.llama_model or default_gguf()
    return LlamaServer(args.llama_server, model, flags, threads=os.cpu_count() or 1).launch()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def engine_pid(server_pid: int) -> int | None:
    """The engine process among the server's children (not a front end)."""
    for tid in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{tid}/children") as f:
            for kid in f.read().split():
                with open(f"/proc/{kid}/cmdline", "rb") as c:
                    if b"structllm.engine" in c.read():
                        return int(kid)
    return None


def load(url: str, items: list[Any], args: argparse.Namespace) -> tuple[list[Result], float]:
    """A short warm-up (not measured), then the workload."""
    warm = prompts(2, 16, args.vocab_size, args.seed + 1, args.text_prompts)
    anyio.run(run_load, url, args.model, warm, 4, math.inf, 2, args.api_key, args.seed)
    return anyio.run(
        run_load,
        url,
        args.model,
        items,
        args.output_len,
        args.request_rate,
        args.max_concurrency,
        args.api_key,
        args.seed,
    )


def front_end_pids(server_pid: int) -> list[int]:
    """The server process and its front-end workers (not the engine)."""
    pids = [server_pid]
    for tid in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{tid}/children") as f:
            for kid in f.read().split():
                with open(f"/proc/{kid}/cmdline", "rb") as c:
                    if b"structllm.server.api_server" in c.read():
                        pids.append(int(kid))
    return pids


def cpu_seconds(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / ticks


def offline(items: list[Any], out_len: int, concurrency: int) -> float:
    from structllm import LLM, SamplingParams

    llm = LLM(max_num_seqs=concurrency)
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(items[:2], SamplingParams(temperature=0, max_tokens=2))
    llm.engine.kv.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(items, sp)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base-url", default=None, help="server to load (default: --launch one)")
    ap.add_argument("--launch", action="store_true", help="start `structllm run` for this run")
    ap.add_argument(
        "--server-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="extra `structllm run` arguments (last)",
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (Poisson); inf = all at once",
    )
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument(
        "--kv-tokens",
        type=int,
        default=0,
        help="both servers' KV cache in tokens (llama-server -c; structllm in float16 bytes), "
        "for memory comparisons (default: structllm's own, llama.cpp's per-slot need)",
    )
    ap.add_argument("--vocab-size", type=int, default=49152)
    ap.add_argument("--text-prompts", action="store_true", help="random words instead of token ids")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--compare-offline",
        action="store_true",
        help="also run the offline engine on the same prompts",
    )
    ap.add_argument(
        "--llama-server",
        default=None,
        help="llama.cpp's llama-server binary: run the same workload on it",
    )
    ap.add_argument(
        "--llama-model",
        default=None,
        help="GGUF file for llama-server (default: structllm's default model)",
    )
    ap.add_argument(
        "--storm",
        type=int,
        default=0,
        metavar="N",
        help="after the load: idle time to first token of an 8-token request, then N streams each "
        "closed by the client --storm-close-after seconds after sending, then one more 8-token "
        "request (the issue's probe: 16)",
    )
    ap.add_argument("--storm-close-after", type=float, default=3.0)
    ap.add_argument("--storm-reps", type=int, default=3, help="storms (medians are reported)")
    ap.add_argument(
        "--skip-load", action="store_true", help="run only the probes (--storm), not the load"
    )
    ap.add_argument(
        "--responses",
        action="store_true",
        help="the Responses workload: overhead over chat, chained-turn TTFT, store p99",
    )
    args = ap.parse_args()
    if args.base_url is None and not args.launch:
        args.launch = True
    items = prompts(args.num_prompts, args.input_len, args.vocab_size, args.seed, args.text_prompts)
    proc = None
    url = args.base_url
    if args.launch:
        proc, url = launch(args)
    cpu = None
    engine_rss = None
    try:
        pids = front_end_pids(proc.pid) if proc is not None else []
        cpu0 = cpu_seconds(pids) if pids else 0.0
        results: list[Result] = []
        elapsed = float("nan")
        if not args.skip_load:
            results, elapsed = load(url, items, args)
        else:  # the probes alone, after the same warm-up
            warm = prompts(2, 16, args.vocab_size, args.seed + 1, args.text_prompts)
            anyio.run(run_load, url, args.model, warm, 4, math.inf, 2, args.api_key, args.seed)
        if pids:
            cpu = cpu_seconds(pids) - cpu0
        engine = engine_pid(proc.pid) if proc is not None else None
        engine_rss = rss_mb(engine) if engine is not None else None
        if args.storm:
            n = args.storm_reps
            flat = prompts(
                n * args.storm, args.input_len, args.vocab_size, args.seed + 2, args.text_prompts
            )
            storms = [flat[k * args.storm : (k + 1) * args.storm] for k in range(n)]
            fresh = prompts(
                2 * n, args.input_len, args.vocab_size, args.seed + 3, args.text_prompts
            )
            probe = anyio.run(
                storm_probe, url, args.model, storms, fresh, args.storm_close_after, args.api_key
            )
        if args.responses:
            import responses as responses_bench  # bench/responses.py, beside this file

            texts = prompts(args.num_prompts, args.input_len, 0, args.seed + 4, True)
            store = next(
                (
                    b
                    for a, b in zip(args.server_args, args.server_args[1:], strict=False)
                    if a == "--responses-store"
                ),
                None,
            )
            front_ends = front_end_pids(proc.pid) if proc is not None else []
            responses_probe = anyio.run(
                responses_bench.probe,
                url,
                args.model,
                texts,
                args.output_len,
                args.max_concurrency,
                store,
                lambda: cpu_seconds(front_ends) if front_ends else float("nan"),
            )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    summary = summarize(results, elapsed) if results else {}
    if args.storm:
        summary.update(probe)
    if args.responses:
        summary.update(responses_probe)
    summary.update(
        bench="serve",
        url=url,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        max_concurrency=args.max_concurrency,
        request_rate=None if math.isinf(args.request_rate) else args.request_rate,
    )
    if engine_rss is not None:
        summary["engine_rss_mb"] = round(engine_rss, 1)
    if cpu is not None and results:
        summary["front_end_processes"] = len(pids)
        summary["front_end_cpu_s"] = round(cpu, 2)
        summary["front_end_cpu_us_per_token"] = round(
            1e6 * cpu / max(1, summary["output_tokens"]), 1
        )
    if args.compare_offline and results:
        off = offline(items, args.output_len, args.max_concurrency)
        summary["offline_output_tokens_per_s"] = round(off, 1)
        summary["serving_vs_offline"] = round(summary["output_tokens_per_s"] / off, 3)
    if args.llama_server and results:
        llama = launch_llama(args)
        try:
            llama_results, llama_elapsed = load(llama.url, items, args)
            llama_rss = rss_mb(llama.pid)
        finally:
            llama.stop()
        theirs = summarize(llama_results, llama_elapsed)
        theirs["rss_mb"] = round(llama_rss, 1)
        summary["llama_cpp"] = theirs
        summary["vs_llama_cpp"] = {
            "output_tokens_per_s": div(
                summary["output_tokens_per_s"], theirs["output_tokens_per_s"]
            ),
            "itl_p50": div(summary["itl_ms_p50"], theirs["itl_ms_p50"]),
            "ttft_p50": div(summary["ttft_ms_p50"], theirs["ttft_ms_p50"]),
        }
    rows = (
        [("output tokens/s", "output_tokens_per_s"), ("requests/s", "requests_per_s")]
        if results
        else []
    )
    for metric in ("ttft_ms", "itl_ms", "e2e_ms") if results else ():
        rows += [(f"{metric} p50/p90/p99", metric)]
    for label, key in rows:
        if key in ("ttft_ms", "itl_ms", "e2e_ms"):
            value = f"{summary[key + '_p50']} / {summary[key + '_p90']} / {summary[key + '_p99']}"
        else:
            value = summary[key]
        print(f"{label:26}{value}", file=sys.stderr)
    if "front_end_cpu_us_per_token" in summary:
        print(
            f"{'front-end CPU us/token':26}{summary['front_end_cpu_us_per_token']} "
            f"({summary['front_end_processes']} processes)",
            file=sys.stderr,
        )
    if "llama_cpp" in summary:
        theirs, ratio = summary["llama_cpp"], summary["vs_llama_cpp"]
        print(
            f"{'llama.cpp tokens/s':26}{theirs['output_tokens_per_s']}  "
            f"(structllm x{ratio['output_tokens_per_s']})",
            file=sys.stderr,
        )
        for metric, key in (("ttft_ms", "ttft_p50"), ("itl_ms", "itl_p50")):
            print(
                f"{'llama.cpp ' + metric + ' p50':26}{theirs[metric + '_p50']}  "
                f"(structllm x{ratio[key]})",
                file=sys.stderr,
            )
        print(
            f"{'RSS MB (engine / llama)':26}{summary.get('engine_rss_mb')} / {theirs['rss_mb']}",
            file=sys.stderr,
        )
    if args.storm:
        print(
            f"{'TTFT idle / after storm':26}{summary['storm_idle_ttft_ms']} / "
            f"{summary['storm_after_ttft_ms']} ms "
            f"({summary['storm_ttft_ratio']}x, medians of {args.storm_reps}: "
            f"{summary['storm_ratios']}; "
            f"{args.storm} streams closed after {args.storm_close_after} s)",
            file=sys.stderr,
        )
    if args.responses:
        responses_bench.report(summary, lambda line: print(line, file=sys.stderr))
    if "offline_output_tokens_per_s" in summary:
        print(
            f"{'offline tokens/s':26}{summary['offline_output_tokens_per_s']}  "
            f"(serving at {summary['serving_vs_offline']:.0%})",
            file=sys.stderr,
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
