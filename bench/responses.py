"""The Responses workload of ``bench/serve.py --responses`` (also runnable alone).

Three figures, each against its baseline in the same run, on the same prompts:

1. per-request overhead of ``/v1/responses`` over ``/v1/chat/completions``: the same
   user messages (random words), ``--output-len`` tokens each with EOS ignored, streamed,
   at ``--max-concurrency``, after every prompt was computed once; Responses, chat, chat,
   Responses (each figure the mean of its two phases). Reported: mean
   end-to-end latency and the front-end processes' CPU seconds per request (the direct
   cost of the extra layer), and their ratios (target: <= 1.05 at concurrency 16).
2. time to first token of a chained turn: a first turn per conversation, then the
   second turn sent with ``previous_response_id`` against the same turn with the whole
   history in ``input`` (``store: false``); both find the history in the prefix cache,
   so the difference is the store read and the replay (target: no slower).
3. the store's write and read latency (p50/p99) while the server is loaded: this process
   opens the server's own SQLite file and times ``put``/``get`` of rows the size of the
   load's, on a thread, during the Responses load of (1) (target: p99 <= 5 ms). The
   server makes the same calls in its worker thread, never on its event loop.

    python bench/serve.py --launch --responses --skip-load --text-prompts \
        --num-prompts 64 --max-concurrency 16 --server-args --responses-store /tmp/r.sqlite3
"""

from __future__ import annotations

import json
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


def _time_store(path: Path, row: dict[str, Any], stop: threading.Event) -> dict[str, list[float]]:
    store = ResponseStore(path, max_bytes=1 << 40, ttl=3600)
    times: dict[str, list[float]] = {"write": [], "read": []}
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
            k += 1
            time.sleep(0.005)  # a sample every few ms, not a competing load of its own
    finally:
        store.close()
    return times


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
        phases: dict[str, list[tuple[float, float]]] = {"chat": [], "responses": []}
        samples: dict[str, list[float]] = {}
        # responses, chat, chat, responses: a drift in the machine's load cancels, and the
        # first measured phase (slower in every run so far, whichever it is) is a
        # Responses one, which can only make the ratio look worse
        for k, name in enumerate(("responses", "chat", "chat", "responses")):
            sampler = None
            stop = threading.Event()
            if k == 3 and store_path:
                row = {
                    "status": "completed",
                    "output": [{"type": "message", "content": [{"text": "x" * 4 * out_len}]}],
                    "conversation": [{"type": "message", "content": [{"text": texts[0]}]}],
                }
                box: dict[str, Any] = {}
                sampler = threading.Thread(
                    target=lambda b=box, r=row, s=stop: b.update(
                        _time_store(Path(store_path), r, s)
                    )
                )
                sampler.start()
            c0 = cpu()
            e2e = await _many(chat if name == "chat" else responses, texts, concurrency)
            phases[name].append((statistics.fmean(e2e), (cpu() - c0) / len(texts)))
            if sampler is not None:
                stop.set()
                sampler.join()
                samples = box

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
        chained, full = [], []
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

    chat_e2e = statistics.fmean(e for e, _ in phases["chat"])
    chat_cpu = statistics.fmean(c for _, c in phases["chat"])
    resp_e2e = statistics.fmean(e for e, _ in phases["responses"])
    resp_cpu = statistics.fmean(c for _, c in phases["responses"])
    out: dict[str, Any] = {
        "phases_e2e_ms": {k: [round(1000 * e, 1) for e, _ in v] for k, v in phases.items()},
        "chat_e2e_ms_mean": round(1000 * chat_e2e, 1),
        "responses_e2e_ms_mean": round(1000 * resp_e2e, 1),
        "responses_vs_chat_e2e": round(resp_e2e / chat_e2e, 3),
        "chat_front_end_cpu_ms_per_request": round(1000 * chat_cpu, 2),
        "responses_front_end_cpu_ms_per_request": round(1000 * resp_cpu, 2),
        "responses_vs_chat_cpu": round(resp_cpu / chat_cpu, 3) if chat_cpu else None,
        "chained_ttft_ms_p50": round(1000 * statistics.median(chained), 1),
        "full_history_ttft_ms_p50": round(1000 * statistics.median(full), 1),
        "chained_vs_full_ttft": round(statistics.median(chained) / statistics.median(full), 3),
        "chained_turns": len(chained),
    }
    for kind in ("write", "read"):
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
    if "store_write_ms_p99" in summary:
        print_line(
            f"{'store write/read p99':26}{summary['store_write_ms_p99']} / "
            f"{summary['store_read_ms_p99']} ms ({summary['store_write_samples']} samples)"
        )
