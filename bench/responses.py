"""The Responses workload of ``bench/serve.py --responses`` (also runnable alone).

Three figures, each against its baseline in the same run, on the same prompts:

1. per-request overhead of ``/v1/responses`` over ``/v1/chat/completions``: the same
   user messages (random words), ``--output-len`` tokens each with EOS ignored, streamed,
   at ``--max-concurrency``, after every prompt was computed once; ``ROUNDS`` rounds of
   Responses, chat, chat, Responses (a drift in the machine's load cancels within a
   round). Reported: each round's ratio of mean end-to-end latency and of the front-end
   processes' CPU seconds per request (the direct cost of the extra layer), and their
   medians over the rounds (target: <= 1.05 at concurrency 16).
2. time to first token of a chained turn: a first turn per conversation, then the
   second turn sent with ``previous_response_id`` against the same turn with the whole
   history in ``input`` (``store: false``); both find the history in the prefix cache,
   so the difference is the store read and the replay (target: no slower).
3. the store's write and read latency under that load: the server's own store calls
   during the Responses phases of (1), from the server's histograms
   (``structllm:responses_store_<kind>_seconds``), each call split into what it is made of:
   ``write``/``read``, the time in SQLite as the store process timed it
   (``perf_counter_ns`` around the transaction: a commit of a group of rows, a read);
   ``write_trip``, a commit's round trip as its group's leader waited, made of
   ``write_send`` (the call's frame sent until the store process had read it: that
   process's turn on a CPU), ``write`` and ``write_resume`` (the reply sent until the
   leader ran again: the event loop's turn); ``write_wait``/``read_wait``, the call as
   its request waited (target: p99 <= 5 ms; for a write, plus the group committing
   before its own). Reported: the bucket bounds under which 50% and 99% fell, and the
   share within 5 ms.
   Beside it, this process times ``put``/``get`` of rows the size of the load's on the
   server's file from a thread of its own (SQLite in this process, as a third writer),
   against the same thread's p99 for a pure-Python loop of the put's median length (what
   the machine's scheduler alone adds at p99: on a loaded machine it dominates any
   few-ms figure).

    python bench/serve.py --launch --responses --skip-load --text-prompts \
        --num-prompts 64 --max-concurrency 16 --server-args --responses-store /tmp/r.sqlite3
"""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx

from structllm.server.response_store import ResponseStore


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def _stream(
    client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], first: str
) -> tuple[float, float, dict[str, Any] | None]:
    """(time to the first event carrying text, end to end, the final response object)."""
    t0 = time.perf_counter()
    ttft = float("nan")
    final = None
    async with client.stream("POST", url + path, json=body) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"{path}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if ttft != ttft and first in line:  # nan: not yet
                ttft = time.perf_counter() - t0
            if data.get("type") in ("response.completed", "response.incomplete"):
                final = data["response"]
    return ttft, time.perf_counter() - t0, final


async def _many(
    fn: Callable[[Any], Awaitable[float]], items: list[Any], concurrency: int
) -> list[float]:
    out: list[float] = []
    limiter = anyio.CapacityLimiter(concurrency)

    async def task(x: Any) -> None:
        async with limiter:
            out.append(await fn(x))

    async with anyio.create_task_group() as tg:
        for x in items:
            tg.start_soon(task, x)
    return out


ROUNDS = 5
# in the store process (SQLite's time), a commit's round trip as its leader waited, and
# each call as its request waited (with, for a write, the commit group before its own)
STORE_HISTOGRAMS = (
    "write_send",
    "write",
    "write_resume",
    "write_trip",
    "write_wait",
    "read",
    "read_wait",
)


def _spin(n: int) -> None:
    x = 0
    for i in range(n):
        x += i


def _time_store(path: Path, row: dict[str, Any], stop: threading.Event) -> dict[str, list[float]]:
    store = ResponseStore(path, max_bytes=1 << 40, ttl=3600)
    times: dict[str, list[float]] = {"write": [], "read": [], "noise": []}
    # a pure-Python loop about as long as a put's median (calibrated on the first puts)
    spin = 0
    k = 0
    try:
        while not stop.is_set():
            rid = f"resp_bench{k}"
            t = time.perf_counter()
            store.put({**row, "id": rid}, row["conversation"])
            times["write"].append(time.perf_counter() - t)
            t = time.perf_counter()
            store.get(rid)
            times["read"].append(time.perf_counter() - t)
            store.delete(rid)
            if k == 20:
                t = time.perf_counter()
                _spin(10000)
                per = (time.perf_counter() - t) / 10000
                spin = max(1, int(statistics.median(times["write"]) / per))
            if spin:
                t = time.perf_counter()
                _spin(spin)
                times["noise"].append(time.perf_counter() - t)
            k += 1
            time.sleep(0.005)  # a sample every few ms, not a competing load of its own
    finally:
        store.close()
    return times


async def _histograms(client: httpx.AsyncClient, url: str) -> dict[str, list[tuple[float, float]]]:
    """The server's store histograms: kind -> [(bucket bound, cumulative count)]."""
    text = (await client.get(url + "/metrics")).text
    out: dict[str, list[tuple[float, float]]] = {}
    for kind in STORE_HISTOGRAMS:
        name = f"structllm:responses_store_{kind}_seconds_bucket"
        out[kind] = [
            (float(le), float(n))
            for le, n in re.findall(rf'^{re.escape(name)}{{.*le="([^"]+)"}} (\S+)$', text, re.M)
        ]
    return out


def _store_figures(calls: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """p50 and p99 (the bound of the bucket that holds each) and the share within 5 ms."""
    out: dict[str, Any] = {}
    for kind, counts in calls.items():
        total = counts[-1][1] if counts else 0
        if not total:
            continue
        p50 = next(le for le, n in counts if n >= 0.5 * total)
        p99 = next(le for le, n in counts if n >= 0.99 * total)
        within = next(n for le, n in counts if le >= 0.005)
        out[f"server_store_{kind}s"] = int(total)
        out[f"server_store_{kind}_ms_p50_at_most"] = 1000 * p50
        out[f"server_store_{kind}_ms_p99_at_most"] = 1000 * p99
        out[f"server_store_{kind}_within_5ms"] = round(within / total, 4)
    return out


async def probe(
    url: str,
    model: str | None,
    texts: list[str],
    out_len: int,
    concurrency: int,
    store_path: str | None,
    cpu: Callable[[], float],
) -> dict[str, Any]:
    """The three figures (see the module docstring). ``cpu()`` is the front-end
    processes' CPU seconds so far (nan when unknown)."""
    limits = httpx.Limits(
        max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8
    )
    extra = {"model": model} if model else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=limits) as client:

        async def chat(text: str) -> float:
            body = {
                **extra,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": out_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            return (await _stream(client, url, "/v1/chat/completions", body, '"content"'))[1]

        async def responses(text: str) -> float:
            body = {
                **extra,
                "input": text,
                "max_output_tokens": out_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            return (await _stream(client, url, "/v1/responses", body, "output_text.delta"))[1]

        await _many(chat, texts[:2], 2)  # warm-up
        await _many(responses, texts[:2], 2)
        rounds: list[dict[str, list[tuple[float, float]]]] = []
        samples: dict[str, list[float]] = {}
        store_calls: dict[str, list[tuple[float, float]]] = {}  # kind -> cumulative buckets
        # rounds of responses, chat, chat, responses: a drift in the machine's load cancels
        # within a round, and the first measured phase (slower in every run so far,
        # whichever it is) is a Responses one, which can only make the ratio look worse
        for rnd in range(ROUNDS):
            phases: dict[str, list[tuple[float, float]]] = {"chat": [], "responses": []}
            for k, name in enumerate(("responses", "chat", "chat", "responses")):
                sampler = None
                stop = threading.Event()
                if rnd == ROUNDS - 1 and k == 3 and store_path:
                    row = {
                        "status": "completed",
                        "output": [{"type": "message", "content": [{"text": "x" * 4 * out_len}]}],
                        "conversation": [{"type": "message", "content": [{"text": texts[0]}]}],
                    }
                    box: dict[str, Any] = {}
                    sampler = threading.Thread(
                        target=lambda b=box, w=row, s=stop: b.update(
                            _time_store(Path(store_path), w, s)
                        )
                    )
                    sampler.start()
                if name == "responses":
                    before = await _histograms(client, url)
                c0 = cpu()
                e2e = await _many(chat if name == "chat" else responses, texts, concurrency)
                phases[name].append((statistics.fmean(e2e), (cpu() - c0) / len(texts)))
                if name == "responses":  # the server's store calls of the Responses phases
                    after = await _histograms(client, url)
                    for kind in STORE_HISTOGRAMS:
                        acc = store_calls.get(kind) or [(le, 0.0) for le, _ in after[kind]]
                        store_calls[kind] = [
                            (le, a + n - m)
                            for (le, a), (_, n), (_, m) in zip(
                                acc, after[kind], before[kind], strict=True
                            )
                        ]
                if sampler is not None:
                    stop.set()
                    sampler.join()
                    samples = box
            rounds.append(phases)

        # chained turns: previous_response_id against the full history
        async def first_turn(text: str) -> dict[str, Any]:
            body = {**extra, "input": text, "max_output_tokens": out_len, "temperature": 0}
            r = await client.post(url + "/v1/responses", json=body)
            return dict(r.json())

        firsts: list[dict[str, Any]] = []

        async def run_first(text: str) -> float:
            firsts.append(await first_turn(text))
            return 0.0

        await _many(run_first, texts[:16], concurrency)  # 16 conversations
        chained: list[float] = []
        full: list[float] = []
        for k, r in enumerate(firsts):  # one at a time: time to first token without queueing
            # two different next turns, so that neither finds the other's in the cache (both
            # find the history, from the first turn), in alternating order
            turns = ("Tell me more.", "Go on, please.")[:: 1 if k % 2 else -1]
            history = await client.get(url + f"/v1/responses/{r['id']}/input_items?order=asc")
            base = {**extra, "max_output_tokens": 16, "temperature": 0, "stream": True}
            chained_body = {**base, "input": turns[0], "previous_response_id": r["id"]}
            items = [*history.json()["data"], *r["output"], {"role": "user", "content": turns[1]}]
            full_body = {**base, "input": items, "store": False}
            for kind in ("chained", "full")[:: 1 if k % 2 else -1]:
                body = chained_body if kind == "chained" else full_body
                ttft = (await _stream(client, url, "/v1/responses", body, "output_text.delta"))[0]
                (chained if kind == "chained" else full).append(ttft)

    def ratio(phases: dict[str, list[tuple[float, float]]], k: int) -> float:
        resp = statistics.fmean(x[k] for x in phases["responses"])
        chat = statistics.fmean(x[k] for x in phases["chat"])
        return resp / chat if chat else float("nan")

    e2e_ratios = [ratio(p, 0) for p in rounds]
    cpu_ratios = [ratio(p, 1) for p in rounds]

    def mean_ms(name: str, k: int) -> float:
        return round(
            1000 * statistics.median(statistics.fmean(x[k] for x in p[name]) for p in rounds), 2
        )

    out: dict[str, Any] = {
        "rounds_e2e_ms": [
            {k: [round(1000 * e, 1) for e, _ in v] for k, v in p.items()} for p in rounds
        ],
        "rounds_responses_vs_chat_e2e": [round(x, 3) for x in e2e_ratios],
        "rounds_responses_vs_chat_cpu": [round(x, 3) for x in cpu_ratios],
        "chat_e2e_ms_mean": mean_ms("chat", 0),
        "responses_e2e_ms_mean": mean_ms("responses", 0),
        "responses_vs_chat_e2e": round(statistics.median(e2e_ratios), 3),
        "chat_front_end_cpu_ms_per_request": mean_ms("chat", 1),
        "responses_front_end_cpu_ms_per_request": mean_ms("responses", 1),
        "responses_vs_chat_cpu": round(statistics.median(cpu_ratios), 3),
        "chained_ttft_ms_p50": round(1000 * statistics.median(chained), 1),
        "full_history_ttft_ms_p50": round(1000 * statistics.median(full), 1),
        "chained_vs_full_ttft": round(statistics.median(chained) / statistics.median(full), 3),
        "chained_turns": len(chained),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        **_store_figures(store_calls),
    }
    for kind in ("write", "read", "noise"):
        if samples.get(kind):
            out[f"store_{kind}_ms_p50"] = round(1000 * _p(samples[kind], 0.5), 3)
            out[f"store_{kind}_ms_p99"] = round(1000 * _p(samples[kind], 0.99), 3)
            out[f"store_{kind}_samples"] = len(samples[kind])
    return out


def report(summary: dict[str, Any], print_line: Callable[[str], None]) -> None:
    print_line(
        f"{'responses/chat e2e':26}{summary['responses_e2e_ms_mean']} / "
        f"{summary['chat_e2e_ms_mean']} ms (x{summary['responses_vs_chat_e2e']})"
    )
    print_line(
        f"{'responses/chat CPU/req':26}{summary['responses_front_end_cpu_ms_per_request']} / "
        f"{summary['chat_front_end_cpu_ms_per_request']} ms (x{summary['responses_vs_chat_cpu']})"
    )
    print_line(
        f"{'chained/full-history TTFT':26}{summary['chained_ttft_ms_p50']} / "
        f"{summary['full_history_ttft_ms_p50']} ms (x{summary['chained_vs_full_ttft']})"
    )
    print_line(
        f"{'rounds responses/chat e2e':26}{summary['rounds_responses_vs_chat_e2e']} "
        f"(CPU {summary['rounds_responses_vs_chat_cpu']})"
    )
    for kind in STORE_HISTOGRAMS:
        if f"server_store_{kind}s" in summary:
            print_line(
                f"{'server store ' + kind:26}p50 <= "
                f"{summary[f'server_store_{kind}_ms_p50_at_most']} ms, p99 <= "
                f"{summary[f'server_store_{kind}_ms_p99_at_most']} ms, "
                f"{100 * summary[f'server_store_{kind}_within_5ms']:.2f}% within 5 ms "
                f"({summary[f'server_store_{kind}s']} calls)"
            )
    print_line(f"{'load average':26}{summary.get('loadavg')}")
    if "store_write_ms_p99" in summary:
        print_line(
            f"{'direct write/read p50':26}{summary['store_write_ms_p50']} / "
            f"{summary['store_read_ms_p50']} ms"
        )
        print_line(
            f"{'direct write/read p99':26}{summary['store_write_ms_p99']} / "
            f"{summary['store_read_ms_p99']} ms ({summary['store_write_samples']} samples; "
            f"a pure-Python loop as long as a write: p99 {summary.get('store_noise_ms_p99')} ms)"
        )
