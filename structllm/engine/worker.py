"""A tensor-parallel worker: ``python -m structllm.engine.worker LAUNCH_JSON``.

Started by rank 0 (``worker_pool.WorkerPool``), it joins the process group, loads its shard
of the model, allocates the KV cache of its own KV heads, then runs every ``StepInput``
that arrives on the broadcast ring through its ``ModelRunner`` (the forward pass, whose
collectives pair with rank 0's) until ``StopWorker``.

It dies with rank 0: ``PR_SET_PDEATHSIG`` when rank 0 spawned it from its main thread,
and in any case a thread blocked on the parent-death pipe, which exits the process at
EOF (rank 0 gone), whatever the main thread is doing (loading, a collective, sleeping).
A failed collective (rank 0 or another worker died) raises out of the loop: exit 1.

A rank on another host than rank 0 (``launch.remote``, started by ``engine.node``) has
no ring: it reads the configuration from the store at ``master_addr``, connects to rank
0's step listener and gets its steps as frames over that connection
(``ipc.step_stream``); the connection's EOF means rank 0 is gone or stopped it.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys
import threading
import traceback

import msgspec
import torch.distributed as dist

from structllm.config import EngineConfig
from structllm.engine.adapters import AdapterRegistry
from structllm.engine.device import (
    drop_library_pages,
    load_rank_model,
    local_num_blocks,
    release_free_heap,
    setup_device,
    worker_device,
)
from structllm.engine.runner import Batch, ModelRunner, PipelineLinks, batch_from_step
from structllm.engine.sampler import Sampler
from structllm.engine.stage_sampling import StageSampler
from structllm.ipc import shm
from structllm.ipc.broadcast import BroadcastRing
from structllm.ipc.broadcast_channel import Subscriber
from structllm.ipc.channel import Doorbell, SpinBudget, spin_window, wake_latency
from structllm.ipc.parent import ParentGone, die_with_parent
from structllm.ipc.step_stream import StreamClosed, connect, recv_frame
from structllm.model.collectives import TensorParallelGroup, connect_group
from structllm.model.files import with_hf_overrides
from structllm.model.formats import resolve_format, resolve_kv_cache_dtype, resolve_lora_dtype
from structllm.model.loader import prepare_model
from structllm.model.sharding import plan_shards
from structllm.model.stages import stage_layers
from structllm.protocol import PROTOCOL_VERSION, StepInput, StopWorker, ToWorker, WorkerLaunch

log = logging.getLogger("structllm.worker")

STORE_TIMEOUT = datetime.timedelta(minutes=10)


def exit_when_parent_goes(pipe_fd: int) -> None:
    """Block on the parent-death pipe in a daemon thread; at EOF, exit at once."""

    def watch() -> None:
        while os.read(pipe_fd, 1):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _discard(first_row: int, logits: object) -> None:
    pass


def worker_loop(
    runner: ModelRunner, sub: Subscriber[ToWorker], spin: SpinBudget, parent_pid: int
) -> int:
    """The step loop. Returns the exit code: 0 after ``StopWorker``."""

    def check_parent() -> None:
        if os.getppid() != parent_pid:
            raise ParentGone

    while True:
        msg = sub.recv(spin, idle=check_parent)
        if isinstance(msg, StopWorker):
            return 0
        assert isinstance(msg, StepInput)
        # the gathered logits stay on rank 0; a sink keeps this rank from collecting its slices
        runner.forward(_batch(runner, msg), sink=_discard)


def remote_loop(runner: ModelRunner, sock: socket.socket, timeout: float) -> int:
    """The step loop of a rank on another host. Returns 0 at ``StopWorker`` or EOF."""
    decoder = msgspec.msgpack.Decoder(ToWorker)
    while True:
        try:
            msg = decoder.decode(recv_frame(sock, lambda: None, timeout))
        except StreamClosed:
            return 0
        if isinstance(msg, StopWorker):
            return 0
        runner.forward(_batch(runner, msg), sink=_discard)


def _batch(runner: ModelRunner, step: StepInput) -> Batch:
    """``step``'s tensors, with its LoRA rows (this rank's slices of the adapters)."""
    batch = batch_from_step(step, runner.device)
    if step.lora_spans and runner.adapters is not None:
        runner.adapters.follow(step.loras)
        batch.lora = runner.adapters.rows(step.lora_spans)
    return batch


def start(launch: WorkerLaunch, store: dist.TCPStore) -> tuple[ModelRunner, TensorParallelGroup]:
    """Join the group, load this rank's shard, size the KV cache with the other ranks.
    A load error is also left in the store for rank 0 to report."""
    config = msgspec.convert(launch.config, EngineConfig)
    timeout = datetime.timedelta(seconds=config.distributed_timeout)
    # on CUDA, the rank's device on its own host: ranks are numbered across the hosts
    device = worker_device(config, launch.rank % (launch.world_size // config.nnodes))
    files = with_hf_overrides(prepare_model(config.model), config.hf_overrides)
    stages = config.pipeline_parallel_size  # > 1: rank = stage * tp + tp_rank
    tp = launch.world_size // stages
    stage, tp_rank = divmod(launch.rank, tp)
    plan = plan_shards(files.config, tp)[tp_rank] if tp > 1 else None
    layers = stage_layers(files.config.num_layers, stages, stage) if stages > 1 else None
    dtype = setup_device(config, device, launch.world_size // config.nnodes)  # this host's
    store.set(f"joined/{launch.rank}", "")
    group = connect_group(
        store, launch.rank, launch.world_size, device, timeout=timeout, hostname=launch.node_addr
    )
    stage_group: TensorParallelGroup | None = None
    try:
        tp_group = group if plan else None
        if plan is not None and stages > 1:  # TP inside each stage: a group per stage
            tp_group = stage_group = connect_group(
                store,
                tp_rank,
                tp,
                device,
                timeout=timeout,
                hostname=launch.node_addr,
                prefix=f"stage{stage}",
            )
        try:
            model = load_rank_model(files, config, device, dtype, plan, tp_group, layers)
        except Exception as e:
            store.set(
                f"failed/{launch.rank}",
                "".join(traceback.format_exception_only(type(e), e)).strip(),
            )
            raise
        store.set(f"loaded/{launch.rank}", "")
        fmt = resolve_format(config, device, files, tp)
        kv_dtype = resolve_kv_cache_dtype(config, device, fmt)
        heads = plan.num_kv_heads if plan else files.config.num_kv_heads
        num_blocks = group.all_reduce_min(
            local_num_blocks(config, device, kv_dtype, files.config, heads, len(layers or ()))
        )
        runner = ModelRunner(model, num_blocks, config.block_size, None, kv_dtype=kv_dtype)
        if config.enable_lora:  # this rank's slices of the adapters rank 0 names
            runner.adapters = AdapterRegistry(
                files.config,
                config.max_cpu_loras or config.max_loras,
                config.max_lora_rank,
                resolve_lora_dtype(config, device, fmt),
                device,
                config.max_loras,
                plan,
            )
        if layers is not None:
            runner.pp = PipelineLinks(group, stage, stages, tp_rank, tp)
            if runner.pp.last and tp_rank == 0:  # samples every row (seeded as rank 0)
                runner.stage_sampler = StageSampler(Sampler(files.generation_eos_ids, config.seed))
        group.also_close = stage_group  # closed with the group, see TensorParallelGroup.close
        if device.type == "cpu":  # as rank 0 does after start-up (EngineCore)
            release_free_heap()
            drop_library_pages()
        return runner, group
    except BaseException:
        group.close()
        if stage_group is not None:
            stage_group.close()
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=os.environ.get("STRUCTLLM_LOG_LEVEL", "WARNING"), format="worker: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: rank 0 decides
    if len(argv) != 1:
        print(
            "usage: python -m structllm.engine.worker LAUNCH_JSON (started by the engine)",
            file=sys.stderr,
        )
        return 2
    launch = msgspec.json.decode(argv[0], type=WorkerLaunch)
    if launch.protocol_version != PROTOCOL_VERSION:
        print(
            f"worker: protocol version {launch.protocol_version} != {PROTOCOL_VERSION}",
            file=sys.stderr,
        )
        return 2
    try:
        if launch.die_with_parent:
            die_with_parent(launch.parent_pid)
        elif os.getppid() != launch.parent_pid:
            raise ParentGone
    except ParentGone:
        return 0
    exit_when_parent_goes(launch.parent_pipe_fd)
    if launch.remote:
        return run_remote(launch)
    mapping = shm.attach(launch.shm_fd, launch.shm_size)
    os.close(launch.shm_fd)
    ring = BroadcastRing(mapping, launch.ring_capacity, launch.world_size // _nnodes(launch) - 1)
    bell, writer_bell = Doorbell(launch.bell_fd), Doorbell(launch.writer_bell_fd)
    sub: Subscriber[ToWorker] = Subscriber(ring, launch.rank - 1, bell, writer_bell, ToWorker)
    store = dist.TCPStore(
        launch.master_addr,
        launch.store_port,
        launch.world_size,
        is_master=False,
        timeout=STORE_TIMEOUT,
    )
    group: TensorParallelGroup | None = None
    try:
        runner, group = start(launch, store)
        return worker_loop(
            runner,
            sub,
            SpinBudget(
                spin_window(launch.spin_us * 1e-6, wake_latency()) if launch.spin_us > 0 else 0.0
            ),
            launch.parent_pid,
        )
    except ParentGone:
        return 0
    except Exception as e:
        return _failed(launch, e)
    finally:
        if group is not None:
            group.close()  # before interpreter teardown, see TensorParallelGroup.close
        ring.close()
        mapping.close()
        bell.close()
        writer_bell.close()


def _nnodes(launch: WorkerLaunch) -> int:
    return int(launch.config.get("nnodes", 1))  # type: ignore[call-overload]


def _failed(launch: WorkerLaunch, e: Exception) -> int:
    # Usually a collective that failed because another rank died: rank 0 reports that.
    log.error(
        "worker %d failed: %s",
        launch.rank,
        "".join(traceback.format_exception_only(type(e), e)).strip(),
    )
    log.debug("traceback", exc_info=True)
    return 1


def run_remote(launch: WorkerLaunch) -> int:
    """A rank on another host: the store and the steps over TCP (no ring)."""
    store = dist.TCPStore(
        launch.master_addr,
        launch.store_port,
        launch.world_size,
        is_master=False,
        timeout=STORE_TIMEOUT,
    )
    config = msgspec.convert(launch.config, EngineConfig)
    group: TensorParallelGroup | None = None
    sock: socket.socket | None = None
    try:
        sock = connect(store.get("structllm/step_addr").decode(), launch.rank, 60.0)
        runner, group = start(launch, store)
        return remote_loop(runner, sock, config.distributed_timeout)
    except Exception as e:
        return _failed(launch, e)
    finally:
        if group is not None:
            group.close()
        if sock is not None:
            sock.close()


if __name__ == "__main__":
    sys.exit(main())
