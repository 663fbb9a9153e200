"""The engine process: ``python -m structllm.engine LAUNCH_JSON``.

Started by the front end (fork+exec), it maps the inherited shared memory, builds the
``EngineCore``, answers with ``EngineReady`` (or ``EngineError``), then loops: drain the
inbound ring, step while there is work, emit one ``OutputBatch`` per step, and sleep on
its doorbell when idle. It dies with its parent: ``PR_SET_PDEATHSIG`` kills it at once,
and the parent-death pipe (whose EOF means the parent is gone) is watched while idle
and between steps, in case the signal was missed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import traceback

import msgspec

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.ipc import shm
from structllm.ipc.channel import Doorbell, Endpoint, SpinBudget
from structllm.protocol import (
    PROTOCOL_VERSION,
    EngineError,
    EngineLaunch,
    EngineReady,
    ToEngine,
)

log = logging.getLogger("structllm.engine")

PR_SET_PDEATHSIG = 1
IDLE_POLL_S = 0.25


class ParentGone(Exception):
    pass


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise ParentGone


def serve(core: EngineCore, ep: Endpoint[ToEngine], parent_fd: int, parent_pid: int, spin: SpinBudget) -> int:
    """The loop. Returns the exit code: 0 after ``Shutdown`` or when the parent is gone."""

    def check_parent() -> None:
        if os.getppid() != parent_pid or select.select([parent_fd], [], [], 0)[0]:
            raise ParentGone

    while True:
        handled = False
        for msg in ep.try_recv():  # in arrival order: an abort never overtakes its add
            if not core.handle(msg):
                return 0
            handled = True
        if core.has_work or handled:
            # After handling messages with nothing to schedule, this still emits the
            # aborts' deltas and fresh stats, so gauges stay true while idle.
            batch = core.step()
            ep.send_blocking(batch, check=check_parent)
            check_parent()
            continue
        if parent_fd in ep.wait(IDLE_POLL_S, spin, extra_fds=(parent_fd,)):
            raise ParentGone


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=os.environ.get("STRUCTLLM_LOG_LEVEL", "WARNING"), format="engine: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the front end decides
    if len(argv) != 1:
        print("usage: python -m structllm.engine LAUNCH_JSON (started by the structllm front end)", file=sys.stderr)
        return 2
    launch = msgspec.json.decode(argv[0], type=EngineLaunch)
    try:
        die_with_parent(launch.parent_pid)
    except ParentGone:
        return 0
    mapping = shm.attach(launch.shm_fd, launch.shm_size)
    os.close(launch.shm_fd)
    to_engine, to_front = shm.rings(mapping, launch.ring_capacity)
    ep: Endpoint[ToEngine] = Endpoint(
        to_engine, to_front, Doorbell(launch.engine_bell_fd), Doorbell(launch.front_bell_fd), ToEngine
    )
    check_gone = lambda: None  # noqa: E731
    try:
        if launch.protocol_version != PROTOCOL_VERSION:
            raise ValueError(f"protocol version {launch.protocol_version} != engine's {PROTOCOL_VERSION}")
        config = msgspec.convert(launch.config, EngineConfig)
        core = EngineCore(config)
    except Exception as e:
        log.debug("start-up failed", exc_info=True)
        ep.send_blocking(EngineError(f"engine failed to start: {e}"), check=check_gone)
        return 1
    ep.send_blocking(
        EngineReady(
            protocol_version=PROTOCOL_VERSION,
            model=core.files.name,
            max_model_len=core.max_model_len,
            vocab_size=core.vocab_size,
            num_kv_blocks=core.num_blocks,
            block_size=config.block_size,
        ),
        check=check_gone,
    )
    try:
        return serve(core, ep, launch.parent_pipe_fd, launch.parent_pid, SpinBudget(launch.spin_us * 1e-6))
    except ParentGone:
        return 0
    except Exception as e:
        # Tell the front end what broke (best effort: the ring may be full), then exit.
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        log.error("engine failed: %s", detail, exc_info=True)
        ep.try_send(EngineError(f"engine failed: {detail}"))
        return 1
