r"""Request priority under load: time to first token of urgent requests on an idle server
and under a saturating low-priority load, side by side.

    python bench/priority.py                       # the default model, small sizes
    python bench/priority.py --load-streams 16 --max-num-seqs 8 --urgent 8
    python bench/priority.py --server-args model.gguf --engine-threads 2

Starts ``structllm run --scheduling-policy priority --max-num-seqs M`` and, for
comparison, the same server with ``--scheduling-policy fcfs`` (``--no-fcfs`` skips it).
On each, ``--rounds`` times: ``--urgent`` urgent requests one after another on the idle
server (idle TTFT), then ``--load-streams`` low-priority streams (priority 10; more
streams than seats, so some always wait) kept in flight by clients that send a new one
when one ends, and under that load the same number of urgent requests (priority 0; 0
under fcfs too, which takes no other value) one after another (loaded TTFT); the load
is then dropped and the next round waits for the server to be idle. Alternating keeps
each idle sample close in time to a loaded one, so other load on the machine skews
both alike. Every prompt is distinct random token ids (no prefix-cache hit flatters a
figure). Prints the medians, the ratio loaded / idle per server and one JSON line. On a
machine with other load, compare ratios only.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
from serve import Result, one, prompts, wait_healthy

LOW, URGENT = 10, 0


async def urgent_ttfts(
    client: httpx.AsyncClient, url: str, items: list[Any], out_len: int, priority: int | None
) -> list[float]:
    ttfts = []
    for p in items:
        r = await one_with_priority(client, url, p, out_len, priority)
        if not r.ok:
            raise SystemExit(f"an urgent request failed: {r.error}")
        ttfts.append(r.ttft)
    return ttfts


async def one_with_priority(
    client: httpx.AsyncClient, url: str, prompt: Any, out_len: int, priority: int | None
) -> Result:
    """``serve.one`` with a ``priority`` field (``None``: none sent)."""
    extra = {} if priority is None else {"priority": priority}
    return await one(client, url, None, prompt, out_len, {}, extra)


async def idle(client: httpx.AsyncClient, url: str) -> None:
    """Wait until the server runs and queues nothing (the aborted load has left)."""
    while True:
        text = (await client.get(url + "/metrics")).text
        busy = re.findall(
            r"^structllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M
        )
        if busy and all(float(v) == 0 for v in busy):
            return
        await anyio.sleep(0.05)


async def loaded_round(
    client: httpx.AsyncClient,
    url: str,
    args: argparse.Namespace,
    policy: str,
    urgent: list[Any],
    low_items: Iterator[Any],
) -> list[float]:
    """Urgent TTFTs under ``--load-streams`` low-priority streams kept in flight."""
    low = LOW if policy == "priority" else None
    prio = URGENT if policy == "priority" else None
    started = anyio.Event()
    loaded: list[float] = []

    async def low_stream() -> None:
        while True:
            r = await one_with_priority(client, url, next(low_items), args.output_len, low)
            if not r.ok:
                raise SystemExit(f"a low-priority request failed: {r.error}")
            started.set()

    async with anyio.create_task_group() as tg:
        for _ in range(args.load_streams):
            tg.start_soon(low_stream)
        await started.wait()  # one low request has ended: the load is steady
        loaded = await urgent_ttfts(client, url, urgent, args.urgent_output_len, prio)
        tg.cancel_scope.cancel()
    return loaded


async def measure(url: str, args: argparse.Namespace, policy: str) -> dict[str, float]:
    """``--rounds`` rounds, each ``--urgent`` urgent requests on the idle server, then as
    many under load: idle and loaded samples close in time, so a machine whose other
    load drifts skews both alike."""
    n, rounds, width = args.urgent, args.rounds, args.load_streams
    items = prompts(2 * n * rounds + 10_000, args.input_len, 49152, args.seed, False)
    urgent_items = iter(items[: 2 * n * rounds])
    low_items = iter(items[2 * n * rounds :])
    limits = httpx.Limits(max_connections=width + 4, max_keepalive_connections=width + 4)
    prio = URGENT if policy == "priority" else None
    idle_s: list[float] = []
    loaded_s: list[float] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=limits) as client:
        for _ in range(rounds):
            await idle(client, url)
            batch = [next(urgent_items) for _ in range(n)]
            idle_s += await urgent_ttfts(client, url, batch, args.urgent_output_len, prio)
            batch = [next(urgent_items) for _ in range(n)]
            loaded_s += await loaded_round(client, url, args, policy, batch, low_items)
    idle_ms, loaded_ms = 1000 * statistics.median(idle_s), 1000 * statistics.median(loaded_s)
    return {
        "idle_ttft_ms": round(idle_ms, 1),
        "loaded_ttft_ms": round(loaded_ms, 1),
        "ratio": round(loaded_ms / idle_ms, 2),
    }


def launch(policy: str, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        *(sys.executable, "-m", "structllm", "run", "--port", str(port)),
        *("--log-level", "warning", "--scheduling-policy", policy),
        *("--max-num-seqs", str(args.max_num_seqs), *args.server_args),
    ]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


def run_policy(policy: str, args: argparse.Namespace) -> dict[str, float]:
    proc, url = launch(policy, args)
    try:
        return anyio.run(measure, url, args, policy)
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--urgent", type=int, default=3, help="urgent requests per phase")
    ap.add_argument("--rounds", type=int, default=3, help="idle then loaded phases")
    ap.add_argument("--urgent-output-len", type=int, default=4)
    ap.add_argument("--load-streams", type=int, default=8, help="low-priority streams in flight")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=64, help="prompt tokens (every request)")
    ap.add_argument("--output-len", type=int, default=48, help="tokens of a low request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-fcfs", action="store_true", help="skip the fcfs server")
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    args = ap.parse_args()
    results = {"priority": run_policy("priority", args)}
    if not args.no_fcfs:
        results["fcfs"] = run_policy("fcfs", args)
    print(f"{'policy':<10}{'idle TTFT ms':>14}{'loaded TTFT ms':>16}{'loaded/idle':>13}")
    for policy, r in results.items():
        print(f"{policy:<10}{r['idle_ttft_ms']:>14}{r['loaded_ttft_ms']:>16}{r['ratio']:>12}x")
    config = {k: v for k, v in vars(args).items() if k != "server_args"}
    print(json.dumps({**config, "server_args": args.server_args, **results}))


if __name__ == "__main__":
    main()
