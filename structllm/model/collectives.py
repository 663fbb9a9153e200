"""This rank's handle on the tensor-parallel process group: the collectives the model runs.

The group is a ``torch.distributed`` backend object of its own (gloo on CPU, NCCL on
CUDA) built on a ``Store`` the engine provides, not the global default group: the
offline ``LLM`` runs rank 0 inside the user's process, which may own a default group of
its own or hold several engines. Collectives are that backend's own (``allreduce``,
``gather``); nothing here reimplements one.

Gloo binds its sockets to ``hostname``: 127.0.0.1 when every rank is on this machine
(nothing off it should be able to connect), the node's own address when the ranks span
several hosts.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


class TensorParallelGroup:
    """Rank ``rank`` of ``world_size``; collectives run on ``device``'s tensors."""

    def __init__(self, backend: Any, rank: int, world_size: int, device: torch.device) -> None:
        # ``Any``: torch's stubs declare the collectives on ``ProcessGroup`` only, while the
        # backend objects (which have them at run time) are typed as bare ``Backend``s.
        self._pg: Any = backend
        self.comm_s = 0.0  # seconds spent in collectives, sends and receives (benchmarks)
        self.also_close: TensorParallelGroup | None = None  # a stage's TP group, on a worker
        self._sending: tuple[Any, Tensor] | None = None  # send_async's (work, tensor)
        self.rank = rank
        self.world_size = world_size
        self.device = device

    def all_reduce(self, t: Tensor) -> None:
        """Sum ``t`` over all ranks, in place (``t`` must be contiguous)."""
        t0 = time.perf_counter()
        self._pg.allreduce([t]).wait()
        self.comm_s += time.perf_counter() - t0

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` of any rank (for agreeing on sizes at start-up)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        self._pg.allreduce([t], opts).wait()
        return int(t.item())

    def gather_to_first(self, t: Tensor) -> list[Tensor] | None:
        """Every rank's ``t`` (same shape on all ranks), in rank order, on rank 0; None
        elsewhere."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        t0 = time.perf_counter()
        try:
            if self.rank == 0:
                out = [torch.empty_like(t) for _ in range(self.world_size)]
                self._pg.gather([out], [t], opts).wait()
                return out
            self._pg.gather([], [t], opts).wait()
            return None
        finally:
            self.comm_s += time.perf_counter() - t0

    def send(self, t: Tensor, dst: int) -> None:
        """``t`` to rank ``dst`` (a pipeline stage's hidden states or logits)."""
        t0 = time.perf_counter()
        self._pg.send([t.contiguous()], dst, 0).wait()
        self.comm_s += time.perf_counter() - t0

    def send_async(self, t: Tensor, dst: int) -> None:
        """``t`` to rank ``dst`` without waiting for it to be taken (a pipeline stage's
        hidden states: the stage goes on to its next batch while the next stage is busy
        with the one before). One such send in flight per group: this waits for the
        previous one first. ``t`` is held until then (the backend reads it in place)."""
        self.flush()
        t = t.contiguous()
        self._sending = (self._pg.send([t], dst, 0), t)

    def flush(self) -> None:
        """Wait for the send of ``send_async`` in flight, if any (bounded by the group's
        timeout; a peer that died fails it)."""
        if self._sending is None:
            return
        work, _ = self._sending
        self._sending = None
        t0 = time.perf_counter()
        work.wait()
        self.comm_s += time.perf_counter() - t0

    def recv(self, t: Tensor, src: int) -> None:
        """Fill ``t`` from rank ``src`` (bounded by the group's timeout)."""
        t0 = time.perf_counter()
        self._pg.recv([t], src, 0).wait()
        self.comm_s += time.perf_counter() - t0

    def close(self) -> None:
        """Drop the backend. Explicitly, not at interpreter teardown: a gloo group whose
        peer died aborts the process (``std::terminate``) if it is destroyed that late."""
        self._pg = None
        self._sending = None
        if self.also_close is not None:
            self.also_close.close()
            self.also_close = None


def connect_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    hostname: str = "127.0.0.1",
    prefix: str = "tp",
) -> TensorParallelGroup:
    """Join the group (blocks until every rank has joined through ``store``)."""
    prefixed = dist.PrefixStore(prefix, store)  # several groups may share one store
    backend: Any
    if device.type == "cuda":
        nccl: Any = dist.ProcessGroupNCCL  # absent from CPU builds of torch
        opts = nccl.Options()
        opts._timeout = timeout
        backend = nccl(prefixed, rank, world_size, opts)
    else:
        gloo: Any = dist.ProcessGroupGloo
        opts = gloo._Options()  # the run-time name; the stubs call it ``Options``
        opts._timeout = timeout
        opts._devices = [gloo.create_device(hostname=hostname)]
        backend = gloo(prefixed, rank, world_size, opts)
    return TensorParallelGroup(backend, rank, world_size, device)
