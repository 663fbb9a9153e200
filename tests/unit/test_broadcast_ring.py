"""The broadcast ring: properties over random interleavings of one writer and several
readers, wrap-around, edges, and the waiting layer across processes."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.ipc import shm
from structllm.ipc.broadcast import BroadcastRing, broadcast_header_size, broadcast_ring_size
from structllm.ipc.broadcast_channel import Publisher, Subscriber
from structllm.ipc.channel import Doorbell, ProtocolError, SpinBudget
from structllm.ipc.ring import LEN_SIZE, FrameTooLarge
from structllm.protocol import StepInput, StopWorker, ToWorker
from tests.support.procs import HANG_S, python_env
from tests.support.rings import frame

CAP = 256


def new_ring(readers: int, capacity: int = CAP) -> BroadcastRing:
    return BroadcastRing(
        mmap.mmap(-1, broadcast_ring_size(capacity, readers)), capacity, readers, init=True
    )


ops = st.lists(
    st.one_of(
        st.tuples(st.just("w"), st.integers(0, CAP - LEN_SIZE)),
        st.tuples(st.just("r"), st.integers(0, 2)),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_every_reader_sees_every_frame_in_order_and_the_slowest_bounds_the_writer(
    script: list[tuple[str, int]],
) -> None:
    """("w", n): write a frame of n bytes if the slowest reader left room; ("r", i):
    reader i reads one frame. Against a model: a queue per reader."""
    ring, queues = new_ring(3), [deque[bytes]() for _ in range(3)]
    for step, (op, arg) in enumerate(script):
        if op == "w":
            data = frame(step, arg)
            used = max(sum(LEN_SIZE + len(f) for f in q) for q in queues)
            fits = used + LEN_SIZE + arg <= CAP
            assert ring.try_write(data) == fits
            assert ring.free_bytes() == CAP - used - (LEN_SIZE + arg if fits else 0)
            if fits:
                for q in queues:
                    q.append(data)
        else:
            want = queues[arg].popleft() if queues[arg] else None
            assert ring.try_read(arg) == want
    for i, q in enumerate(queues):
        while q:
            assert ring.try_read(i) == q.popleft()
        assert ring.try_read(i) is None
    assert ring.free_bytes() == CAP


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 100, CAP - LEN_SIZE])
def test_wrap_around_at_every_offset(size: int) -> None:
    """A frame (length prefix included) starting at each byte of the data area, read by
    both readers."""
    for offset in range(CAP):
        ring = new_ring(2)
        pos = 0
        while pos % CAP != offset:  # filler frames up to the offset
            gap = (offset - pos) % CAP
            n = gap - LEN_SIZE if gap >= LEN_SIZE else CAP // 2
            assert ring.try_write(bytes(n))
            assert ring.try_read(0) == ring.try_read(1) == bytes(n)
            pos += LEN_SIZE + n
        data = frame(offset, size)
        assert ring.try_write(data)
        assert ring.try_read(1) == data and ring.try_read(0) == data
        assert ring.try_read(0) is None and ring.try_read(1) is None


def test_the_slowest_reader_holds_the_writer_back() -> None:
    ring = new_ring(2)
    big = frame(1, CAP - LEN_SIZE)
    assert ring.try_write(big)  # exactly full
    assert ring.try_read(0) == big  # reader 0 is done, reader 1 is not
    assert not ring.try_write(b"")
    assert ring.free_bytes() == 0 and ring.lag(1) == CAP
    assert ring.try_read(1) == big
    assert ring.try_write(b"x") and ring.try_read(0) == b"x" and ring.try_read(1) == b"x"


def test_views_in_separate_objects_share_the_counters() -> None:
    buf = mmap.mmap(-1, broadcast_ring_size(CAP, 2))
    writer = BroadcastRing(buf, CAP, 2, init=True)
    r0, r1 = BroadcastRing(buf, CAP, 2), BroadcastRing(buf, CAP, 2)
    assert writer.try_write(b"hello")
    assert r1.readable(1) and r1.try_read(1) == b"hello"
    assert writer.free_bytes() == CAP - LEN_SIZE - 5  # reader 0 has not read it yet
    assert r0.try_read(0) == b"hello" and r0.try_read(0) is None
    assert writer.free_bytes() == CAP
    for ring in (writer, r0, r1):
        ring.close()


def test_counters_have_cache_lines_of_their_own() -> None:
    ring = new_ring(4)
    addrs = [
        ring._tail_addr,
        ring.writer_waiting_addr,
        *ring._head_addrs,
        *ring.reader_waiting_addrs,
    ]
    lines = {a // 64 for a in addrs}
    assert len(lines) == len(addrs)
    assert broadcast_header_size(4) % 64 == 0


def test_edges_are_rejected_with_clear_errors() -> None:
    ring = new_ring(1)
    with pytest.raises(FrameTooLarge, match=rf"frame of {CAP} bytes .* capacity of {CAP} bytes"):
        ring.try_write(bytes(CAP))
    with pytest.raises(ValueError, match="at least one reader"):
        BroadcastRing(mmap.mmap(-1, 4096), CAP, 0)
    with pytest.raises(ValueError, match="power of two"):
        BroadcastRing(mmap.mmap(-1, 4096), 100, 1)
    with pytest.raises(ValueError, match="writable bytes"):
        BroadcastRing(mmap.mmap(-1, broadcast_ring_size(CAP, 1)), CAP, 2)


def step(n: int) -> StepInput:
    ids = bytearray(n.to_bytes(8, "little") * 3)
    return StepInput(ids, ids, ids, bytearray(8), [n], [0, n], 0, [n - 1])


def channel(readers: int, capacity: int = 1 << 12) -> tuple[Publisher, list[Subscriber[ToWorker]]]:
    ring = new_ring(readers, capacity)
    bells, writer_bell = [Doorbell() for _ in range(readers)], Doorbell()
    pub = Publisher(ring, bells, writer_bell)
    subs: list[Subscriber[ToWorker]] = [
        Subscriber(ring, i, bells[i], writer_bell, ToWorker) for i in range(readers)
    ]
    return pub, subs


def test_a_sleeping_subscriber_is_woken_by_the_doorbell() -> None:
    pub, (sub,) = channel(1)
    got: list[ToWorker] = []
    # its periodic wake-up is an hour away: only the doorbell can wake it in time
    t = threading.Thread(
        target=lambda: got.append(sub.recv(SpinBudget(0), timeout=3600.0)), daemon=True
    )
    t.start()
    time.sleep(0.2)  # the reader is most likely asleep on its doorbell by now
    pub.publish(step(3))
    t.join(HANG_S)
    assert got == [step(3)], "the doorbell did not wake the reader"


def test_a_garbage_frame_is_a_protocol_error() -> None:
    pub, (sub,) = channel(1)
    assert pub.try_publish_bytes(b"\xc1 not msgpack")
    with pytest.raises(ProtocolError, match="malformed broadcast frame"):
        sub.try_recv()


READER = textwrap.dedent(
    """
    import sys, zlib
    from structllm.ipc import shm
    from structllm.ipc.broadcast import BroadcastRing
    from structllm.ipc.broadcast_channel import Subscriber
    from structllm.ipc.channel import Doorbell, SpinBudget
    from structllm.protocol import StepInput, StopWorker, ToWorker

    fd, size, cap, readers, index, bell, wbell, slow = map(int, sys.argv[1:])
    mapping = shm.attach(fd, size)
    ring = BroadcastRing(mapping, cap, readers)
    sub = Subscriber(ring, index, Doorbell(bell), Doorbell(wbell), ToWorker)
    crc, n = 0, 0
    while True:
        msg = sub.recv(SpinBudget(20e-6 if index else 0.0))
        if isinstance(msg, StopWorker):
            break
        crc = zlib.crc32(bytes(msg.input_ids), crc)
        n += 1
        if slow and n % 500 == 0:
            import time; time.sleep(0.01)
    print(n, crc, flush=True)
    """
)


def test_two_reader_processes_receive_everything_under_back_pressure() -> None:
    """5000 frames of varying size through a 4 KiB ring to two processes (one spins, one
    sleeps and now and then stalls): both see every frame in order, the writer waits."""
    import zlib

    readers, cap = 2, 1 << 12
    size = broadcast_ring_size(cap, readers)
    mapping, fd = shm.create(size)
    ring = BroadcastRing(mapping, cap, readers, init=True)
    bells, writer_bell = [Doorbell() for _ in range(readers)], Doorbell()
    pub = Publisher(ring, bells, writer_bell)
    env = python_env()

    def argv(i: int) -> list[str]:  # reader 1 stalls now and then
        args = [fd, size, cap, readers, i, bells[i].fd, writer_bell.fd, i]
        return [sys.executable, "-c", READER, *map(str, args)]

    procs = [
        subprocess.Popen(
            argv(i),
            pass_fds=(fd, bells[i].fd, writer_bell.fd),
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(readers)
    ]

    def readers_alive() -> None:
        for p in procs:
            assert p.poll() is None, f"reader exited early with code {p.returncode}"

    try:
        os.close(fd)
        crc = 0
        for i in range(5000):
            n = 1 + (i * 7919) % 60
            msg = StepInput(
                bytearray(frame(i, 8 * n)), bytearray(), bytearray(), bytearray(), [], [0], 0, []
            )
            crc = zlib.crc32(bytes(msg.input_ids), crc)
            pub.publish(msg, timeout=0.05, check=readers_alive)
        pub.publish(StopWorker())
        outs = [p.communicate(timeout=60)[0].split() for p in procs]
        assert outs == [["5000", str(crc)]] * readers
        assert pub.space_waits > 0
    finally:
        for p in procs:
            p.kill()
            p.wait()
        ring.close()
        mapping.close()
        for b in [*bells, writer_bell]:
            b.close()
