"""The engine process: ``python -m structllm.engine LAUNCH_JSON``.

Started by the front end (fork+exec), it maps the inherited shared memory, builds the
``EngineCore``, answers with ``EngineReady`` (or ``EngineError``), then loops: drain the
inbound ring, step while there is work, emit one ``OutputBatch`` per step, and sleep on
its doorbell when idle. While a step runs it peeks at the rings between layers (what it
reads waits for the next drain), so that a step whose requests were all aborted, or
that a strictly more urgent arrival outranks, is cut short (``EngineCore.step``,
``engine.held``). It dies with its parent: ``PR_SET_PDEATHSIG`` kills it at once, and
the parent-death pipe (whose EOF means the parent is gone) is watched while idle and
between steps, in case the signal was missed.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import time
import traceback

import msgspec

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.engine.held import Held
from structllm.ipc import shm
from structllm.ipc.channel import (
    Doorbell,
    Endpoint,
    SpinBudget,
    spin_window,
    wait_any,
    wake_latency,
)
from structllm.ipc.parent import ParentGone, die_with_parent
from structllm.protocol import (
    PROTOCOL_VERSION,
    AddRequest,
    EngineError,
    EngineLaunch,
    EngineReady,
    OutputBatch,
    ToEngine,
    TokenDelta,
)

log = logging.getLogger("structllm.engine")

IDLE_POLL_S = 0.25
# idle this long: hand back the heap the steps kept (EngineCore.release_idle_memory)
IDLE_RELEASE_S = 1.0
STATS_INTERVAL_S = 0.1


def engine_loop(
    core: EngineCore,
    eps: list[Endpoint[ToEngine]],
    parent_fd: int,
    parent_pid: int,
    spin: SpinBudget,
) -> int:
    """The loop over one channel per front end. Returns the exit code: 0 after
    ``Shutdown`` (from any front end) or when the parent is gone.

    Fairness: the channels are drained in turn, starting one further each pass. Routing:
    each request's deltas go to the channel its ``AddRequest`` came from. A channel gets
    an ``OutputBatch`` in a step that has deltas for it or after it sent anything (so a
    ``GetStats`` or an abort is answered with fresh stats), and at least every
    ``STATS_INTERVAL_S`` while the engine works, so every front end's gauges stay true."""

    def check_parent() -> None:
        if os.getppid() != parent_pid or select.select([parent_fd], [], [], 0)[0]:
            raise ParentGone

    owner: dict[str, int] = {}
    first = 0
    last_sent = [0.0] * len(eps)
    # Messages read while a step runs, held until it ends (applied first next pass), and
    # their summary: the step is cut short once their aborts cover all of its requests
    # or one of them is more urgent than all of them (EngineCore.step, Held).
    held: list[list[ToEngine]] = [[] for _ in eps]
    pending = Held()

    def peek() -> Held:
        for i, ep in enumerate(eps):
            msgs = ep.try_recv()
            held[i] += msgs
            pending.add(msgs)
        return pending

    last_busy = time.monotonic()  # when the engine last had requests
    released = True  # the heap was handed back since (start-up did)
    while True:
        asked = [False] * len(eps)  # channels that sent something: they get a batch
        for k in range(len(eps)):
            i = (first + k) % len(eps)
            msgs, held[i] = [*held[i], *eps[i].try_recv()], []
            for msg in msgs:  # in arrival order: an abort never overtakes its add
                if isinstance(msg, AddRequest):
                    owner[msg.request_id] = i
                if not core.handle(msg):
                    return 0
                asked[i] = True
        pending.clear()  # every held message is applied now
        first = (first + 1) % len(eps)
        if core.has_work:
            last_busy, released = time.monotonic(), False
        if core.has_work or any(asked):
            # After handling messages with nothing to schedule, this still emits the
            # aborts' deltas and fresh stats, so gauges stay true while idle.
            batch = core.step(peek)
            outs: list[list[TokenDelta]] = [[] for _ in eps]
            for d in batch.outputs:
                outs[owner.get(d.request_id, 0)].append(d)
                if d.finish_reason is not None:
                    owner.pop(d.request_id, None)
            now = time.monotonic()
            for i, ep in enumerate(eps):
                # A channel with nothing in this step still hears the stats now and then
                # (and whenever it asked), rather than at every step of others' work.
                if outs[i] or asked[i] or now - last_sent[i] > STATS_INTERVAL_S:
                    ep.send_blocking(OutputBatch(outs[i], batch.stats), check=check_parent)
                    last_sent[i] = now
            check_parent()
            continue
        if not released and time.monotonic() - last_busy >= IDLE_RELEASE_S:
            core.release_idle_memory()  # once per idle period
            released = True
        ready = wait_any(eps, IDLE_POLL_S, spin, extra_fds=(parent_fd, *core.watch_fds))
        if parent_fd in ready:
            raise ParentGone
        if ready:
            core.check_workers()  # a tensor-parallel worker died: raises


def process_spin(spin_us: float) -> float:
    """The engine's spin window: ``spin_us``, widened where wake-ups are slow."""
    return spin_window(spin_us * 1e-6, wake_latency()) if spin_us > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=os.environ.get("STRUCTLLM_LOG_LEVEL", "WARNING"), format="engine: %(message)s"
    )
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C reaches the process group: the front end decides
    if len(argv) != 1:
        print(
            "usage: python -m structllm.engine LAUNCH_JSON (started by the structllm front end)",
            file=sys.stderr,
        )
        return 2
    launch = msgspec.json.decode(argv[0], type=EngineLaunch)
    try:
        die_with_parent(launch.parent_pid)
    except ParentGone:
        return 0
    mapping = shm.attach(launch.shm_fd, launch.shm_size)
    os.close(launch.shm_fd)
    bell = Doorbell(launch.engine_bell_fd)
    eps: list[Endpoint[ToEngine]] = []
    for i, front_fd in enumerate(launch.front_bell_fds):
        to_engine, to_front = shm.rings(mapping, launch.ring_capacity, channel=i)
        eps.append(Endpoint(to_engine, to_front, bell, Doorbell(front_fd), ToEngine))

    def tell_all(msg: EngineError | EngineReady) -> None:
        for ep in eps:
            ep.send_blocking(msg, check=lambda: None)

    try:
        if launch.protocol_version != PROTOCOL_VERSION:
            raise ValueError(
                f"protocol version {launch.protocol_version} != engine's {PROTOCOL_VERSION}"
            )
        config = msgspec.convert(launch.config, EngineConfig)
        core = EngineCore(config)
    except Exception as e:
        log.debug("start-up failed", exc_info=True)
        tell_all(EngineError(f"engine failed to start: {e}"))
        return 1
    tell_all(
        EngineReady(
            protocol_version=PROTOCOL_VERSION,
            model=core.files.name,
            max_model_len=core.max_model_len,
            vocab_size=core.vocab_size,
            num_kv_blocks=core.num_blocks,
            block_size=config.block_size,
            pooler=core.pooler_info,
        )
    )
    try:
        return engine_loop(
            core,
            eps,
            launch.parent_pipe_fd,
            launch.parent_pid,
            SpinBudget(process_spin(launch.spin_us)),
        )
    except ParentGone:
        return 0
    except Exception as e:
        # Tell the front end what broke (best effort: the ring may be full), then exit.
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        log.error("engine failed: %s", detail, exc_info=True)
        for ep in eps:
            ep.try_send(EngineError(f"engine failed: {detail}"))
        return 1
    finally:
        core.close()  # stops tensor-parallel workers
