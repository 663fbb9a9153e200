"""Rank 0's side of tensor parallelism: the worker processes (ranks 1..N-1), the store
they meet at, and the broadcast ring that carries each step to them.

``WorkerPool`` owns every resource of the workers and releases all of them in
``close`` (also run by a ``weakref.finalize`` when the pool is collected and at
interpreter exit, so an offline ``LLM`` that is never closed still leaves no process
behind):

- a ``TCPStore`` listening on 127.0.0.1 (a free port picked by the kernel, so no race
  for it), where the ranks rendezvous; the process group is built on it;
- one shared-memory broadcast ring (private, unlinked at once, see ``ipc.shm``) with one
  reader per worker, a doorbell per worker and one for rank 0;
- a pipe whose write end only rank 0 holds: its EOF tells a worker that rank 0 is gone;
- the worker processes (``python -m structllm.engine.worker``, ``ipc.spawn``) and a pidfd
  each, which is how rank 0 notices a worker's death: while it waits for ring space,
  when a collective fails, and (through ``watch_fds``) while the engine sleeps.

Start-up: ``start`` spawns the workers; ``connect`` waits until each has reached the
store, then joins the group; after loading its own shard, rank 0 calls
``wait_loaded``, in which a worker's load error arrives as the worker's message.

Across hosts (``config.nnodes`` > 1) the store listens on ``master_addr:master_port``,
this pool spawns only the ranks of node 0 (1..k-1 of k per node), and the ranks of the
other nodes, started there by ``engine.node``, find the configuration and rank 0's step
listener in the store; each gets its steps over its own TCP connection
(``ipc.step_stream``), whose closing is how rank 0 notices that rank's death.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import select
import socket
import subprocess
import threading
import time
import weakref
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from structllm.config import EngineConfig, SpeculativeConfig
from structllm.engine.stage_sampling import frame_allowance
from structllm.engine.step_budget import budget_upper_bound
from structllm.ipc import shm
from structllm.ipc.broadcast import BroadcastRing, broadcast_ring_size
from structllm.ipc.broadcast_channel import Publisher
from structllm.ipc.channel import Doorbell
from structllm.ipc.spawn import Child, spawn
from structllm.ipc.step_stream import HELLO, StepSender, read_exact
from structllm.model.collectives import TensorParallelGroup, connect_group
from structllm.protocol import PROTOCOL_VERSION, StepInput, StopWorker, WorkerLaunch

STARTUP_TIMEOUT = datetime.timedelta(minutes=10)
SHUTDOWN_GRACE_S = 5.0
MIN_RING_CAPACITY = 1 << 20


class WorkerDied(RuntimeError):
    """A tensor-parallel worker exited while the engine needed it."""


class WorkerStartError(RuntimeError):
    """A tensor-parallel worker failed before it was ready."""


def ring_capacity_for(config: EngineConfig, max_positions: int, vocab_size: int = 0) -> int:
    """A power of two that holds two of the largest possible ``StepInput`` frames (or one
    per pipeline stage: that many batches are in flight, and the last stage reads a
    batch's frame only once the stages before it are done with it): three int64 arrays
    per token, a block table of int32 per sequence, a few ints per sequence and msgpack
    overhead; with pipeline stages, the last stage's sampling rows (a grammar mask per
    row and the step's budget of settings and history, ``stage_sampling``)."""
    blocks = -(-max_positions // config.block_size)
    tokens = budget_upper_bound(config.max_num_batched_tokens, config.max_num_seqs)
    worst = 24 * tokens + config.max_num_seqs * (4 * blocks + 3 * 9) + 1024
    if config.pipeline_parallel_size > 1:
        # drafts may be on by default (speculative_config None): room for them either way
        spec = config.speculative_config or SpeculativeConfig()
        rows = min(tokens, config.max_num_seqs * (1 + spec.num_speculative_tokens))
        worst += frame_allowance(rows, vocab_size, max_positions)
    cap = MIN_RING_CAPACITY
    while cap < max(2, config.pipeline_parallel_size) * worst:
        cap *= 2
    return cap


class _Resources:
    """Everything a pool must release; ``release`` is idempotent and never raises."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.fds: list[int] = []  # pipe ends and the shm descriptor, until handed over
        self.bells: list[Doorbell] = []
        self.mapping: Any = None
        self.ring: BroadcastRing | None = None
        self.publisher: Publisher | None = None
        self.group: TensorParallelGroup | None = None
        self.stage_group: TensorParallelGroup | None = None  # TP inside rank 0's stage
        self.store: dist.TCPStore | None = None
        self.listener: socket.socket | None = None  # rank 0's step listener (several nodes)
        self.remotes: list[StepSender] = []  # one per rank on another node
        self.ray: Any = None  # ray_executor.RayRanks, with the ray backend

    def release(self) -> None:
        try:
            self._stop_workers()
        finally:
            for child in self.children:
                child.close()
            for fd in self.fds:
                os.close(fd)
            self.children, self.fds = [], []
            for bell in self.bells:
                bell.close()
            if self.ring is not None:
                self.ring.close()
                self.ring = None
            self.publisher = None
            if self.mapping is not None:
                self.mapping.close()
                self.mapping = None
            for remote in self.remotes:
                remote.close()
            self.remotes = []
            if self.ray is not None:
                self.ray.close()
                self.ray = None
            if self.listener is not None:
                self.listener.close()
                self.listener = None
            self.store = None

    def _stop_workers(self) -> None:
        """Ask the workers to stop, leave the group, wait a grace period, kill what is
        left; always reap. Leaving the group fails the collective of a worker stuck
        mid-step (rank 0 abandoned that step), so it exits at once too."""
        stop = msgspec.msgpack.encode(StopWorker())
        if self.publisher is not None and any(c.returncode is None for c in self.children):
            with contextlib.suppress(OSError):  # a doorbell of a worker that is gone
                self.publisher.try_publish_bytes(stop)
        for remote in self.remotes:
            with contextlib.suppress(OSError):  # a rank that is gone
                remote.send(stop)
        for g in (self.group, self.stage_group):
            if g is not None:
                g.close()
        self.group = self.stage_group = None
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for child in self.children:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
        for child in self.children:
            child.wait()


class WorkerPool:
    """Ranks 1..``world_size``-1 of an engine whose rank 0 is this process."""

    def __init__(
        self, config: EngineConfig, world_size: int, ring_capacity: int, spin_us: float = 50.0
    ) -> None:
        self.world_size = world_size
        self.config = config
        self.publish_s = 0.0  # seconds spent handing steps to the workers (benchmarks)
        # ranks on this host: all of them, or the first of ``nnodes`` equal parts; with
        # Ray, only rank 0 (the others are actors wherever Ray places them)
        self.ray = config.distributed_executor_backend == "ray"
        self.local_size = 1 if self.ray else world_size // config.nnodes
        self.distributed = self.ray or config.nnodes > 1
        if self.ray:
            from structllm.engine.ray_executor import node_ip

            self.node_addr = node_ip()
        elif config.nnodes > 1:
            self.node_addr = config.node_addr or config.master_addr
        else:
            self.node_addr = "127.0.0.1"
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.release)
        try:
            self._start(config, ring_capacity, spin_us)
        except BaseException:
            self.close()
            raise

    def _start(self, config: EngineConfig, capacity: int, spin_us: float) -> None:
        res = self._res
        n = self.local_size - 1  # workers on this host
        res.store = dist.TCPStore(
            self.node_addr
            if self.ray
            else config.master_addr
            if config.nnodes > 1
            else "127.0.0.1",
            config.master_port if config.nnodes > 1 else 0,
            self.world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=STARTUP_TIMEOUT,
        )
        if self.distributed:
            self._listen(config)
        if self.ray:
            self._start_actors(config, res.store.port)
        if n == 0:
            return
        size = broadcast_ring_size(capacity, n)
        res.mapping, shm_fd = shm.create(size)
        res.fds.append(shm_fd)
        res.ring = BroadcastRing(res.mapping, capacity, n, init=True)
        for _ in range(n + 1):  # one per worker, then the writer's; owned by res as each opens
            res.bells.append(Doorbell())
        *bells, writer_bell = res.bells
        res.publisher = Publisher(res.ring, bells, writer_bell)
        pipe_r, pipe_w = os.pipe()
        res.fds += [pipe_r, pipe_w]
        on_main_thread = threading.current_thread() is threading.main_thread()
        for rank in range(1, self.local_size):
            launch = WorkerLaunch(
                protocol_version=PROTOCOL_VERSION,
                config=msgspec.to_builtins(config),
                rank=rank,
                world_size=self.world_size,
                store_port=res.store.port,
                shm_fd=shm_fd,
                shm_size=size,
                ring_capacity=capacity,
                bell_fd=bells[rank - 1].fd,
                writer_bell_fd=writer_bell.fd,
                parent_pipe_fd=pipe_r,
                parent_pid=os.getpid(),
                die_with_parent=on_main_thread,
                spin_us=spin_us,
                master_addr=config.master_addr if config.nnodes > 1 else "127.0.0.1",
                node_addr=self.node_addr,
            )
            res.children.append(
                spawn(
                    "structllm.engine.worker",
                    launch,
                    (shm_fd, bells[rank - 1].fd, writer_bell.fd, pipe_r),
                )
            )
        # The workers hold their copies now; rank 0 keeps only the pipe's write end.
        for fd in (shm_fd, pipe_r):
            res.fds.remove(fd)
            os.close(fd)

    def _start_actors(self, config: EngineConfig, store_port: int) -> None:
        from structllm.engine.ray_executor import RayRanks

        launches = [
            WorkerLaunch(
                protocol_version=PROTOCOL_VERSION,
                config=msgspec.to_builtins(config),
                rank=rank,
                world_size=self.world_size,
                store_port=store_port,
                shm_fd=-1,
                shm_size=0,
                ring_capacity=0,
                bell_fd=-1,
                writer_bell_fd=-1,
                parent_pipe_fd=-1,
                parent_pid=os.getpid(),
                die_with_parent=False,
                remote=True,
                master_addr=self.node_addr,
            )
            for rank in range(1, self.world_size)
        ]
        self._res.ray = RayRanks(launches)

    def _listen(self, config: EngineConfig) -> None:
        """Several nodes: rank 0's step listener, and what the other nodes' ranks read
        from the store (the configuration, the world, where to get their steps)."""
        res = self._res
        assert res.store is not None
        res.listener = socket.create_server((self.node_addr, 0))
        port = res.listener.getsockname()[1]
        res.store.set("structllm/step_addr", f"{self.node_addr}:{port}")
        res.store.set("structllm/world_size", str(self.world_size))
        res.store.set("structllm/config", msgspec.json.encode(config).decode())

    # -- start-up ----------------------------------------------------------------------

    def connect(self, device: torch.device) -> TensorParallelGroup:
        """Join the process group as rank 0, once every worker has reached the store (so
        a worker that dies early fails the start instead of stalling it)."""
        store = self._store()
        self._accept_remotes()
        self._wait_for_keys(
            [f"joined/{r}" for r in range(1, self.world_size)], "join the process group"
        )
        group = connect_group(
            store,
            0,
            self.world_size,
            device,
            timeout=datetime.timedelta(seconds=self.config.distributed_timeout),
            hostname=self.node_addr,
        )
        self._res.group = group
        return group

    def connect_stage(
        self, device: torch.device, stage: int, tp_rank: int, tp_size: int
    ) -> TensorParallelGroup:
        """The tensor-parallel group of pipeline stage ``stage`` (after ``connect``)."""
        group = connect_group(
            self._store(),
            tp_rank,
            tp_size,
            device,
            timeout=datetime.timedelta(seconds=self.config.distributed_timeout),
            hostname=self.node_addr,
            prefix=f"stage{stage}",
        )
        self._res.stage_group = group
        return group

    def _accept_remotes(self) -> None:
        """One step connection from each rank on another node (which says its rank
        first), failing fast if a local worker exits meanwhile."""
        res = self._res
        if res.listener is None:
            return
        want = set(range(self.local_size, self.world_size))
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        res.listener.settimeout(0.1)
        while want:
            self.check(WorkerStartError, "before the other nodes connected")
            if time.monotonic() > deadline:
                raise WorkerStartError(
                    f"tensor-parallel ranks {sorted(want)} (other nodes) did not connect "
                    f"within {STARTUP_TIMEOUT}"
                )
            try:
                sock, _ = res.listener.accept()
            except TimeoutError:
                continue
            try:
                sock.settimeout(self.config.distributed_timeout)
                (rank,) = HELLO.unpack(read_exact(sock, HELLO.size))
            except OSError:
                sock.close()
                continue
            if rank not in want:  # a stale rank of an earlier engine, or a duplicate
                sock.close()
                continue
            want.discard(rank)
            res.remotes.append(StepSender(sock, rank, self.config.distributed_timeout))
        # every rank is connected: a stale rank of this engine's predecessor that reaches
        # the store now is refused at once instead of waiting for a group that is complete
        res.listener.close()
        res.listener = None

    def wait_loaded(self) -> None:
        """Wait until every worker has loaded its shard; raises ``WorkerStartError`` with
        a worker's own error message if one failed."""
        store = self._store()
        for r in range(1, self.world_size):
            key = self._wait_for_keys([f"loaded/{r}", f"failed/{r}"], "load the model", any_of=True)
            if key.startswith("failed/"):
                raise WorkerStartError(
                    f"tensor-parallel worker {r} failed to start: {store.get(key).decode()}"
                )

    def _store(self) -> dist.TCPStore:
        assert self._res.store is not None, "the pool is closed"
        return self._res.store

    def _wait_for_keys(self, keys: list[str], what: str, any_of: bool = False) -> str:
        """Poll the store for ``keys`` (all, or the first of ``any_of``), failing fast
        when a worker exits. Returns the key found (the last one when waiting for all)."""
        store = self._store()
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        pending = list(keys)
        while True:
            for key in list(pending):
                if store.check([key]):
                    if any_of:
                        return key
                    pending.remove(key)
            if not pending:
                return keys[-1]
            self.check(WorkerStartError, f"before it could {what}")
            if time.monotonic() > deadline:
                raise WorkerStartError(
                    f"tensor-parallel workers did not {what} within {STARTUP_TIMEOUT}"
                )
            select.select([c.pidfd for c in self._res.children], [], [], 0.01)

    # -- steps -------------------------------------------------------------------------

    def publish(self, step: StepInput) -> None:
        """Send one step to every worker (waits while the slowest one catches up)."""
        t0 = time.perf_counter()
        try:
            self._publish(step)
        finally:
            self.publish_s += time.perf_counter() - t0

    def _publish(self, step: StepInput) -> None:
        res = self._res
        if res.store is None:
            raise WorkerDied(
                "the tensor-parallel workers were stopped after a failed step; start a new engine"
            )
        if res.publisher is not None:
            res.publisher.publish(
                step, check=self.check, extra_fds=tuple([c.pidfd for c in res.children])
            )
        if res.remotes:
            frame = msgspec.msgpack.encode(step)
            for remote in res.remotes:
                try:
                    remote.send(frame)
                except OSError as e:
                    raise WorkerDied(
                        f"tensor-parallel rank {remote.rank} (another node) is gone: {e}"
                    ) from e

    @property
    def watch_fds(self) -> tuple[int, ...]:
        """File descriptors that become readable when a worker exits (pidfds, and the
        step connections of ranks on other nodes)."""
        return tuple(
            [c.pidfd for c in self._res.children] + [r.fileno() for r in self._res.remotes]
        )

    def ray_bundle_nodes(self) -> list[str]:
        """With the ray backend: the Ray node id of each rank's bundle, in rank order."""
        assert self._res.ray is not None, "not the ray backend"
        nodes: list[str] = self._res.ray.bundle_nodes()
        return nodes

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self._res.children]

    def check(self, error: type[RuntimeError] = WorkerDied, when: str = "") -> None:
        """Raise ``error`` naming the first worker that has exited, if any."""
        for rank, child in enumerate(self._res.children, start=1):
            if child.returncode is not None:
                suffix = f" {when}" if when else ""
                raise error(
                    f"tensor-parallel worker {rank} (pid {child.pid}) "
                    f"{child.describe_exit()}{suffix}"
                )
        for remote in self._res.remotes:
            if remote.dead():
                suffix = f" {when}" if when else ""
                raise error(
                    f"tensor-parallel rank {remote.rank} (another node) closed its "
                    f"connection{suffix}"
                )

    def raise_if_dead(self, cause: BaseException, wait_s: float = 1.0) -> None:
        """After a failed collective: if a worker has died (or dies within ``wait_s``:
        its sockets close a moment before it can be reaped), raise ``WorkerDied`` from
        ``cause``."""
        if self.watch_fds:
            select.select(list(self.watch_fds), [], [], wait_s)
        try:
            self.check()
        except WorkerDied as e:
            raise e from cause

    # -- shutdown ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop and reap the workers and release everything (idempotent)."""
        self._finalizer()
