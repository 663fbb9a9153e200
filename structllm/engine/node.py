"""A node other than node 0 of a multi-host engine: ``structllm run --nnodes N
--node-rank R --master-addr A --master-port P`` on host R.

It serves no HTTP. In a loop, for as long as it runs: meet node 0's engine at its store
(``A:P``; retried until an engine is there), read the engine's configuration and world
size from it, spawn this node's ranks (``R*k .. R*k+k-1`` of ``k = world // N``) as
remote workers (``engine.worker``, ``WorkerLaunch.remote``), and wait until one of them
exits: the engine ended (its connections closed) or a rank failed, which ends the
engine too. Then the others are stopped and the node waits for the next engine (node
0's front end restarts its engine as after any engine death).

SIGTERM or SIGINT stops the ranks and exits 0. The ranks die with this process
(``PR_SET_PDEATHSIG`` and the parent-death pipe, as every worker).
"""

from __future__ import annotations

import datetime
import os
import select
import signal
import subprocess
import sys
import threading

import msgspec
import torch.distributed as dist

from structllm.config import EngineConfig
from structllm.ipc.spawn import Child, spawn
from structllm.protocol import PROTOCOL_VERSION, WorkerLaunch

JOIN_TIMEOUT = datetime.timedelta(seconds=30)  # one attempt to reach node 0's store
RETRY_S = 1.0  # between attempts, and after an engine ended
GRACE_S = 5.0


def say(msg: str) -> None:
    print(f"structllm node: {msg}", file=sys.stderr, flush=True)


def join(master_addr: str, master_port: int) -> tuple[EngineConfig, int, int] | None:
    """Node 0's configuration, world size and store port, or None if no engine is there
    (yet)."""
    try:
        store = dist.TCPStore(master_addr, master_port, is_master=False, timeout=JOIN_TIMEOUT)
        world = int(store.get("structllm/world_size"))
        config = msgspec.json.decode(store.get("structllm/config"), type=EngineConfig)
    except (RuntimeError, ValueError, msgspec.DecodeError):  # DistStoreError is a RuntimeError
        return None
    return config, world, master_port


def start_ranks(
    config: EngineConfig, world: int, node_rank: int, node_addr: str
) -> tuple[list[Child], int]:
    """This node's ranks, and the write end of their parent-death pipe."""
    k = world // config.nnodes
    pipe_r, pipe_w = os.pipe()  # the write end stays here: its EOF tells the ranks we are gone
    children: list[Child] = []
    try:
        for rank in range(node_rank * k, (node_rank + 1) * k):
            launch = WorkerLaunch(
                protocol_version=PROTOCOL_VERSION,
                config=msgspec.to_builtins(config),
                rank=rank,
                world_size=world,
                store_port=config.master_port,
                shm_fd=-1,
                shm_size=0,
                ring_capacity=0,
                bell_fd=-1,
                writer_bell_fd=-1,
                parent_pipe_fd=pipe_r,
                parent_pid=os.getpid(),
                die_with_parent=threading.current_thread() is threading.main_thread(),
                remote=True,
                master_addr=config.master_addr,
                node_addr=node_addr,
            )
            children.append(spawn("structllm.engine.worker", launch, (pipe_r,)))
    except BaseException:
        os.close(pipe_w)
        for child in children:
            child.close()
        raise
    finally:
        os.close(pipe_r)
    return children, pipe_w


def stop_ranks(children: list[Child], pipe_w: int) -> None:
    os.close(pipe_w)  # EOF: the ranks exit
    for child in children:
        try:
            child.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
    for child in children:
        child.close()


def run_node(
    nnodes: int, node_rank: int, master_addr: str, master_port: int, node_addr: str | None
) -> int:
    if not 0 < node_rank < nnodes:
        say(f"--node-rank must be in [1, {nnodes}) here (node 0 runs the server)")
        return 2
    stopping = threading.Event()
    wake_r, wake_w = os.pipe()

    def on_signal(signum: int, frame: object) -> None:
        stopping.set()
        os.write(wake_w, b"x")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    addr = node_addr or master_addr
    say(f"node {node_rank} of {nnodes} ({addr}): waiting for node 0 at {master_addr}:{master_port}")
    try:
        while not stopping.is_set():
            joined = join(master_addr, master_port)
            if joined is None:
                select.select([wake_r], [], [], RETRY_S)
                continue
            config, world, _ = joined
            if config.nnodes != nnodes:
                say(f"node 0 runs with --nnodes {config.nnodes}, this node with {nnodes}")
                return 2
            children, pipe_w = start_ranks(config, world, node_rank, addr)
            try:
                say(f"ranks {[c.pid for c in children]} joined an engine of {world} ranks")
                select.select([wake_r, *[c.pidfd for c in children]], [], [])
            finally:
                stop_ranks(children, pipe_w)
            if not stopping.is_set():
                say("the engine ended; waiting for the next one")
                select.select([wake_r], [], [], RETRY_S)
    finally:
        os.close(wake_r)
        os.close(wake_w)
    return 0
