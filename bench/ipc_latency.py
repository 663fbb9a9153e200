"""IPC between two processes: structllm's rings against vLLM's transport (ZeroMQ).

    python bench/ipc_latency.py            # 20k round trips per case
    python bench/ipc_latency.py --quick    # 3k
    python bench/ipc_latency.py --quick --wake-delay-us 78 --cases ring_trio_spin,ring_trio_nospin
                                           # as on a VM whose wake-ups cost 78 us

Round trip: the "front end" (an event loop, or plain code for the sync baselines)
sends a ``TokenDelta``-like message encoded with msgspec; the "engine" (a plain
blocking process) echoes the frame; the front end decodes it. Reported: p50 / p99 /
p99.9 round trip in microseconds, CPU seconds per round trip (both processes), and
one-way messages/s from the engine to the front end (the engine streams as fast as it
can; the front end receives and decodes everything).

Cases: structllm ring with the front end on trio and on asyncio, with the default
spin window and with spinning off; pyzmq PUSH/PULL over ``ipc://`` with ``zmq.asyncio``
on the front end (vLLM's setup); plain synchronous pyzmq; ``multiprocessing.Pipe``.
Prints a table and one JSON line with the ratios to the ``zmq.asyncio`` baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec

STREAM_N = 100_000
OLD_SPIN = False  # --old-spin
WAKE_DELAY_US = 0.0  # --wake-delay-us: simulated cost of each wake-up (ring cases only)


class Delta(msgspec.Struct, array_like=True, gc=False):
    """Shaped like ``protocol.TokenDelta``; ``pad`` sets the frame size."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    pad: bytes


def payload(size: int) -> Delta:
    d = Delta("req-123456", [4242], None, b"")
    base = len(msgspec.msgpack.encode(d))
    return Delta("req-123456", [4242], None, b"x" * max(0, size - base - 3))


def percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)

    def p(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))] * 1e6

    return {"p50_us": round(p(0.5), 1), "p99_us": round(p(0.99), 1), "p999_us": round(p(0.999), 1)}


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---------------------------------------------------------------------------------------
# engine-side workers (run as `python ipc_latency.py --worker KIND ARGS_JSON`)


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def slow_wakeups(delay_s: float) -> None:
    """Make every sleep on a doorbell come back ``delay_s`` late, in this process: a
    stand-in for a machine (a VM) where a wake-up costs that much. The process is held
    busy for the delay (as a vCPU being woken is, from the peer's point of view: not
    there yet). Used by ``--wake-delay-us``."""
    if delay_s <= 0:
        return
    import anyio

    from structllm.ipc import channel

    class SlowPoll:
        def __init__(self) -> None:
            self.p = select_poll()

        def register(self, fd: int, mask: int) -> None:
            self.p.register(fd, mask)

        def poll(self, timeout: int) -> list[tuple[int, int]]:
            out = self.p.poll(timeout)
            busy(delay_s)
            return out

    import select

    select_poll = select.poll

    class Shim:
        poll = SlowPoll
        POLLIN, POLLHUP = select.POLLIN, select.POLLHUP

    channel.select = Shim  # type: ignore[assignment]
    wait_readable = anyio.wait_readable

    async def slow_wait_readable(fd: int) -> None:
        await wait_readable(fd)
        busy(delay_s)

    anyio.wait_readable = slow_wait_readable  # type: ignore[assignment]


SLEEPS = [0]  # times this process went to sleep on its doorbell


def count_sleeps(ep: Any) -> None:
    begin = ep.sleep_begin

    def counted(*a: Any, **k: Any) -> bool:
        slept = bool(begin(*a, **k))
        SLEEPS[0] += slept
        return slept

    ep.sleep_begin = counted


def old_spin_policy() -> None:
    """The spin policy before issue 13 (for A/B runs, ``--old-spin``): the window as
    configured whatever a wake-up costs, and halved by any wait over one window."""
    from structllm.ipc import channel

    channel.IDLE_WAIT_WINDOWS = 1
    channel.WAKE_SPIN_FACTOR = 0


def worker(kind: str, args: dict[str, Any]) -> None:
    n, mode = args["n"], args["mode"]
    slow_wakeups(args.get("wake_delay_us", 0.0) * 1e-6)
    if args.get("old_spin"):
        old_spin_policy()
    frame = msgspec.msgpack.encode(payload(args["size"]))
    if kind == "ring":
        from structllm.ipc import shm
        from structllm.ipc.channel import Doorbell, Endpoint, SpinBudget, spin_window, wake_latency

        mapping = shm.attach(args["fd"], args["shm_size"])
        to_engine, to_front = shm.rings(mapping, args["capacity"])
        ep: Endpoint[object] = Endpoint(
            to_engine, to_front, Doorbell(args["engine_bell"]), Doorbell(args["front_bell"]), object
        )
        spin = SpinBudget(
            spin_window(args["spin_us"] * 1e-6, wake_latency()) if args["spin_us"] else 0.0
        )
        count_sleeps(ep)
        if mode == "pingpong":
            done = 0
            while done < n:
                frames = ep.try_recv_bytes()
                if not frames:
                    ep.wait(1.0, spin)
                    continue
                for f in frames:
                    while not ep.try_send_bytes(f):
                        ep.wait(1.0, ep.space_spin, want_read=False, want_space=len(f))
                    done += 1
        else:
            ep.wait(5.0)  # start signal
            ep.try_recv_bytes()
            for _ in range(n):
                while not ep.try_send_bytes(frame):
                    ep.wait(1.0, ep.space_spin, want_read=False, want_space=len(frame))
    elif kind in ("zmq", "zmq_sync"):
        import zmq

        ctx = zmq.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(args["to_engine"])
        push.connect(args["to_front"])
        if mode == "pingpong":
            for _ in range(n):
                push.send(pull.recv(), copy=False)
        else:
            pull.recv()
            for _ in range(n):
                push.send(frame, copy=False)
        time.sleep(0.2)
        ctx.destroy(linger=1000)
    elif kind == "pipe":
        import multiprocessing.connection as mpc

        conn = mpc.Connection(args["fd"])
        if mode == "pingpong":
            for _ in range(n):
                conn.send_bytes(conn.recv_bytes())
        else:
            conn.recv_bytes()
            for _ in range(n):
                conn.send_bytes(frame)
    print(json.dumps({"cpu": self_cpu(), "sleeps": SLEEPS[0]}), flush=True)


def spawn(kind: str, args: dict[str, Any], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--worker", kind, json.dumps(args)],
        pass_fds=pass_fds,
        stdout=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], out: dict[str, float] | None = None) -> float:
    """The worker's CPU seconds; with ``out``, its sleeps go there too."""
    text, _ = proc.communicate(timeout=120)
    report = json.loads(text.strip().splitlines()[-1])
    if out is not None and "sleeps" in report:
        out["engine_sleeps"] = report["sleeps"]
    return float(report["cpu"])


# ---------------------------------------------------------------------------------------
# front-end sides


def run_ring(backend: str, spin_us: float, size: int, n: int, mode: str) -> dict[str, float]:
    import anyio

    from structllm.ipc import shm
    from structllm.ipc.async_channel import AsyncEndpoint
    from structllm.ipc.channel import Doorbell, Endpoint

    capacity = 1 << 22
    shm_size = shm.channel_size(capacity)
    mapping, fd = shm.create(shm_size)
    to_engine, to_front = shm.rings(mapping, capacity, init=True)
    front_bell, engine_bell = Doorbell(), Doorbell()
    args = {
        "n": n,
        "mode": mode,
        "size": size,
        "fd": fd,
        "shm_size": shm_size,
        "capacity": capacity,
        "engine_bell": engine_bell.fd,
        "front_bell": front_bell.fd,
        "spin_us": spin_us,
        "wake_delay_us": WAKE_DELAY_US,
        "old_spin": OLD_SPIN,
    }
    proc = spawn("ring", args, (fd, engine_bell.fd, front_bell.fd))
    os.close(fd)
    ep = AsyncEndpoint(
        Endpoint(to_front, to_engine, front_bell, engine_bell, Delta), spin_s=spin_us * 1e-6
    )
    SLEEPS[0] = 0
    count_sleeps(ep.ep)
    msg = payload(size)
    out: dict[str, float] = {}

    async def pingpong() -> None:
        rtts = []
        for _ in range(n):
            t = time.perf_counter()
            await ep.send(msg)
            await ep.recv()
            rtts.append(time.perf_counter() - t)
        out.update(percentiles(rtts[n // 10 :]))

    async def stream() -> None:
        await ep.send(msg)
        got, t = 0, time.perf_counter()
        while got < n:
            got += len(await ep.recv())
        out["msgs_per_s"] = n / (time.perf_counter() - t)

    cpu0 = self_cpu()
    anyio.run(pingpong if mode == "pingpong" else stream, backend=backend)
    out["cpu_s"] = self_cpu() - cpu0 + finish(proc, out)
    out["front_sleeps"] = SLEEPS[0]
    to_engine.close()
    to_front.close()
    mapping.close()
    return out


def run_zmq_async(size: int, n: int, mode: str) -> dict[str, float]:
    import asyncio

    import zmq
    import zmq.asyncio

    d = tempfile.mkdtemp()
    to_engine, to_front = f"ipc://{d}/e", f"ipc://{d}/f"
    proc = spawn(
        "zmq", {"n": n, "mode": mode, "size": size, "to_engine": to_engine, "to_front": to_front}
    )
    dec = msgspec.msgpack.Decoder(Delta)
    enc = msgspec.msgpack.Encoder()
    msg = payload(size)
    out: dict[str, float] = {}

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        pull.bind(to_front)
        push.connect(to_engine)
        if mode == "pingpong":
            rtts = []
            for _ in range(n):
                t = time.perf_counter()
                await push.send(enc.encode(msg), copy=False)
                dec.decode(await pull.recv())
                rtts.append(time.perf_counter() - t)
            out.update(percentiles(rtts[n // 10 :]))
        else:
            await push.send(enc.encode(msg))
            t = time.perf_counter()
            for _ in range(n):
                dec.decode(await pull.recv())
            out["msgs_per_s"] = n / (time.perf_counter() - t)
        ctx.destroy(linger=0)

    cpu0 = self_cpu()
    asyncio.run(main())
    out["cpu_s"] = self_cpu() - cpu0 + finish(proc)
    return out


def run_zmq_sync(size: int, n: int, mode: str) -> dict[str, float]:
    import zmq

    d = tempfile.mkdtemp()
    to_engine, to_front = f"ipc://{d}/e", f"ipc://{d}/f"
    proc = spawn(
        "zmq_sync",
        {"n": n, "mode": mode, "size": size, "to_engine": to_engine, "to_front": to_front},
    )
    dec = msgspec.msgpack.Decoder(Delta)
    enc = msgspec.msgpack.Encoder()
    msg = payload(size)
    out: dict[str, float] = {}
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind(to_front)
    push.connect(to_engine)
    cpu0 = self_cpu()
    if mode == "pingpong":
        rtts = []
        for _ in range(n):
            t = time.perf_counter()
            push.send(enc.encode(msg), copy=False)
            dec.decode(pull.recv())
            rtts.append(time.perf_counter() - t)
        out.update(percentiles(rtts[n // 10 :]))
    else:
        push.send(enc.encode(msg))
        t = time.perf_counter()
        for _ in range(n):
            dec.decode(pull.recv())
        out["msgs_per_s"] = n / (time.perf_counter() - t)
    ctx.destroy(linger=0)
    out["cpu_s"] = self_cpu() - cpu0 + finish(proc)
    return out


def run_pipe(size: int, n: int, mode: str) -> dict[str, float]:
    import multiprocessing as mp

    a, b = mp.Pipe()
    proc = spawn("pipe", {"n": n, "mode": mode, "size": size, "fd": b.fileno()}, (b.fileno(),))
    b.close()
    dec = msgspec.msgpack.Decoder(Delta)
    enc = msgspec.msgpack.Encoder()
    msg = payload(size)
    out: dict[str, float] = {}
    cpu0 = self_cpu()
    if mode == "pingpong":
        rtts = []
        for _ in range(n):
            t = time.perf_counter()
            a.send_bytes(enc.encode(msg))
            dec.decode(a.recv_bytes())
            rtts.append(time.perf_counter() - t)
        out.update(percentiles(rtts[n // 10 :]))
    else:
        a.send_bytes(enc.encode(msg))
        t = time.perf_counter()
        for _ in range(n):
            dec.decode(a.recv_bytes())
        out["msgs_per_s"] = n / (time.perf_counter() - t)
    out["cpu_s"] = self_cpu() - cpu0 + finish(proc)
    return out


CASES: dict[str, Any] = {
    "ring_trio_spin": lambda s, n, m: run_ring("trio", 50.0, s, n, m),
    "ring_trio_nospin": lambda s, n, m: run_ring("trio", 0.0, s, n, m),
    "ring_asyncio_spin": lambda s, n, m: run_ring("asyncio", 50.0, s, n, m),
    "ring_asyncio_nospin": lambda s, n, m: run_ring("asyncio", 0.0, s, n, m),
    "zmq_asyncio": run_zmq_async,
    "zmq_sync": run_zmq_sync,
    "mp_pipe": run_pipe,
}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], json.loads(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-n", type=int, default=20_000, help="round trips per case")
    ap.add_argument("--stream", type=int, default=STREAM_N, help="messages for the one-way rate")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES)
    )
    ap.add_argument("--sizes", default="64,4096", help="frame sizes in bytes")
    ap.add_argument(
        "--wake-delay-us",
        type=float,
        default=0.0,
        help="ring cases: every sleep on a doorbell comes back this much later (both processes), "
        "to mimic a machine with slow wake-ups (a VM: ~78 us)",
    )
    ap.add_argument(
        "--old-spin", action="store_true", help="the spin policy before issue 13 (for A/B runs)"
    )
    args = ap.parse_args()
    global WAKE_DELAY_US, OLD_SPIN
    WAKE_DELAY_US, OLD_SPIN = args.wake_delay_us, args.old_spin
    slow_wakeups(WAKE_DELAY_US * 1e-6)
    if OLD_SPIN:
        old_spin_policy()
    cases = [c for c in args.cases.split(",") if c]
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.quick:
        args.n, args.stream = 3000, 20_000
    results: dict[str, Any] = {}
    for size in sizes:
        for name in cases:
            fn = CASES[name]
            pp = fn(size, args.n, "pingpong")
            st = fn(size, args.stream, "stream")
            results[f"{name}_{size}"] = {
                **{k: v for k, v in pp.items() if k != "cpu_s"},
                "cpu_us_per_rt": round(pp["cpu_s"] / args.n * 1e6, 1),
                **(
                    {"sleeps_per_rt": round((pp["front_sleeps"] + pp["engine_sleeps"]) / args.n, 2)}
                    if "front_sleeps" in pp
                    else {}
                ),
                "msgs_per_s": round(st["msgs_per_s"]),
            }
    print(
        f"{'case':26}{'p50 us':>9}{'p99 us':>9}{'p99.9 us':>10}"
        f"{'cpu us/rt':>11}{'msgs/s':>11}{'sleeps/rt':>10}",
        file=sys.stderr,
    )
    for name, r in results.items():
        print(
            f"{name:26}{r['p50_us']:>9}{r['p99_us']:>9}{r['p999_us']:>10}{r['cpu_us_per_rt']:>11}{r['msgs_per_s']:>11}"
            f"{r.get('sleeps_per_rt', ''):>10}",
            file=sys.stderr,
        )
    ratios = {}
    for size in sizes:
        for name in (
            "ring_trio_spin",
            "ring_trio_nospin",
            "ring_asyncio_spin",
            "ring_asyncio_nospin",
        ):
            r = results.get(f"{name}_{size}")
            base, sync = results.get(f"zmq_asyncio_{size}"), results.get(f"zmq_sync_{size}")
            if r is None:
                continue
            if base is not None:
                ratios[f"{name}_{size}_p50_vs_zmq_asyncio"] = round(r["p50_us"] / base["p50_us"], 3)
                ratios[f"{name}_{size}_rate_vs_zmq_asyncio"] = round(
                    r["msgs_per_s"] / base["msgs_per_s"], 2
                )
            if sync is not None:
                ratios[f"{name}_{size}_rate_vs_zmq_sync"] = round(
                    r["msgs_per_s"] / sync["msgs_per_s"], 2
                )
    print(
        json.dumps(
            {"bench": "ipc_latency", "round_trips": args.n, "results": results, "ratios": ratios}
        )
    )


if __name__ == "__main__":
    main()
