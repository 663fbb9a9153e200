"""The sans-IO pieces of running past one machine: how layers split into pipeline
stages, a stage's weights, and the step stream's frames and end-of-stream."""

from __future__ import annotations

import select
import socket

import pytest

from structllm.ipc.step_stream import HELLO, StepSender, StreamClosed, read_exact, recv_frame
from structllm.model.loader import stage_weights
from structllm.model.stages import stage_layers


@pytest.mark.parametrize(("layers", "stages"), [(30, 2), (30, 4), (7, 3), (2, 2), (5, 5)])
def test_stages_cover_the_layers_in_order_and_differ_by_at_most_one(
    layers: int, stages: int
) -> None:
    parts = [stage_layers(layers, stages, s) for s in range(stages)]
    assert [i for p in parts for i in p] == list(range(layers))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert all(len(p) >= 1 for p in parts)


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="between 1 and the model's 2 layers"):
        stage_layers(2, 3, 0)


def test_a_stage_keeps_its_layers_renumbered_and_the_rest() -> None:
    weights = {"embed_tokens": 0, "norm": 1, **{f"layers.{i}.o_proj": 10 + i for i in range(4)}}
    assert stage_weights(weights, range(2, 4)) == {
        "embed_tokens": 0,
        "norm": 1,
        "layers.0.o_proj": 12,
        "layers.1.o_proj": 13,
    }


def test_frames_arrive_whole_and_eof_ends_the_stream() -> None:
    a, b = socket.socketpair()
    frames = [b"", b"x", bytes(range(256)) * 40]  # all fit the socket buffer
    for f in frames:
        a.sendall(len(f).to_bytes(4, "little") + f)
    got = [recv_frame(b, lambda: None, 5.0) for _ in frames]
    assert got == frames
    a.close()
    with pytest.raises(StreamClosed):
        recv_frame(b, lambda: None, 5.0)
    b.close()


def test_rank_0_sees_a_closed_rank_as_dead() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    rank = socket.create_connection(listener.getsockname())
    rank.sendall(HELLO.pack(3))
    conn, _ = listener.accept()
    assert HELLO.unpack(read_exact(conn, HELLO.size)) == (3,)
    sender = StepSender(conn, 3, timeout=5)
    sender.send(b"step")
    assert read_exact(rank, 8)[4:] == b"step"
    assert not sender.dead()
    rank.close()
    select.select([conn], [], [], 5)  # the close arrives as an event; dead() only looks
    assert sender.dead()
    sender.close()
    listener.close()


def test_a_cuda_group_is_nccl_and_a_cpu_group_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: NCCL's process group is replaced by a recorder, to check that a CUDA
    device takes the NCCL branch with the group's timeout (gloo runs for real below)."""
    import datetime

    import torch
    import torch.distributed as dist

    from structllm.model.collectives import connect_group

    made: list[tuple[int, int, datetime.timedelta]] = []

    class FakeNCCL:
        class Options:
            _timeout = datetime.timedelta(0)

        def __init__(self, store: object, rank: int, size: int, opts: FakeNCCL.Options) -> None:
            made.append((rank, size, opts._timeout))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=7)
    group = connect_group(store, 0, 1, torch.device("cuda", 0), timeout=timeout)
    assert isinstance(group._pg, FakeNCCL) and made == [(0, 1, timeout)]
    cpu = connect_group(store, 0, 1, torch.device("cpu"), timeout=timeout, prefix="cpu")
    assert type(cpu._pg).__name__ == "ProcessGroupGloo"
    cpu.close()
