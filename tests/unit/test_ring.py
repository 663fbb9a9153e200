"""The sans-IO ring: properties over random frame sequences, wrap-around, edges."""

from __future__ import annotations

import mmap
from collections import deque

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.ipc import atomics
from structllm.ipc.channel import Doorbell, Endpoint, ProtocolError
from structllm.ipc.ring import LEN_SIZE, FrameTooLarge, Ring, ring_size
from structllm.protocol import AddRequest, SamplingParams, ToEngine
from tests.support.rings import frame

CAP = 256


def new_ring(capacity: int = CAP) -> Ring:
    return Ring(mmap.mmap(-1, ring_size(capacity)), capacity, init=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, CAP - LEN_SIZE), st.just(-1)), max_size=200))
def test_random_writes_and_reads_preserve_order_and_content(ops: list[int]) -> None:
    """Non-negative op: write a frame of that size (if it fits); -1: read one."""
    ring, model = new_ring(), deque[bytes]()
    used = 0
    for i, op in enumerate(ops):
        if op >= 0:
            data = frame(i, op)
            fits = used + LEN_SIZE + op <= CAP
            assert ring.try_write(data) == fits
            if fits:
                model.append(data)
                used += LEN_SIZE + op
        else:
            got = ring.try_read()
            want = model.popleft() if model else None
            assert got == want
            if want is not None:
                used -= LEN_SIZE + len(want)
    while model:
        assert ring.try_read() == model.popleft()
    assert ring.try_read() is None


def advance_to(ring: Ring, pos: int, offset: int) -> int:
    """Write and read filler frames until the next frame starts at ``offset`` of the data
    area; returns the new position."""
    while pos % CAP != offset:
        gap = (offset - pos) % CAP
        n = gap - LEN_SIZE if gap >= LEN_SIZE else CAP // 2  # too close: go round once more
        assert ring.try_write(bytes(n)) and ring.try_read() == bytes(n)
        pos += LEN_SIZE + n
    return pos


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 100, CAP - LEN_SIZE])
def test_wrap_around_at_every_offset(size: int) -> None:
    """A frame (length prefix included) starting at each byte of the data area."""
    for offset in range(CAP):
        ring = new_ring()
        pos = advance_to(ring, 0, offset)
        data = frame(offset, size)
        assert ring.try_write(data)
        assert ring.try_read() == data
        assert ring.try_read() is None
        assert pos % CAP == offset


def test_every_start_position_with_wrapping_frames() -> None:
    ring = new_ring()
    pos = 0
    for step in range(3 * CAP):
        n = 1 + (step * 37) % (CAP - LEN_SIZE)
        data = frame(step, n)
        assert ring.try_write(data)
        assert ring.try_read() == data
        pos += LEN_SIZE + n
    assert pos > 2 * CAP  # went round several times, starting at many offsets


def test_full_and_empty_edges() -> None:
    ring = new_ring()
    assert ring.try_read() is None
    big = frame(1, CAP - LEN_SIZE)
    assert ring.try_write(big)  # exactly full
    assert ring.free_bytes() == 0
    assert not ring.try_write(b"")  # even an empty frame needs its length
    assert ring.try_read() == big
    assert ring.try_read() is None
    assert ring.try_write(b"") and ring.try_read() == b""


def test_oversized_frame_names_both_sizes() -> None:
    ring = new_ring()
    with pytest.raises(FrameTooLarge, match=rf"frame of {CAP} bytes .* capacity of {CAP} bytes"):
        ring.try_write(bytes(CAP))


def test_oversized_frame_raises_even_when_the_ring_is_partly_full() -> None:
    # too large is an error, not "no space yet" (a writer would wait for it forever)
    ring = new_ring()
    assert ring.try_write(b"abc")
    with pytest.raises(FrameTooLarge):
        ring.try_write(bytes(CAP - LEN_SIZE + 1))
    assert ring.try_read() == b"abc" and ring.try_write(bytes(CAP - LEN_SIZE))  # exact fit
    assert ring.try_read() == bytes(CAP - LEN_SIZE)


def test_capacity_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        Ring(mmap.mmap(-1, ring_size(100)), 100)


def test_two_views_of_one_buffer_see_each_other() -> None:
    buf = mmap.mmap(-1, ring_size(CAP))
    producer, consumer = Ring(buf, CAP, init=True), Ring(buf, CAP)
    assert producer.try_write(b"hello")
    assert consumer.readable()
    assert consumer.try_read() == b"hello"
    assert producer.free_bytes() == CAP


def test_counters_are_published_through_the_atomics(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_store, real_load = atomics.store_release, atomics.load_acquire

    def store(addr: int, value: int) -> None:
        calls.append("store")
        real_store(addr, value)

    def load(addr: int) -> int:
        calls.append("load")
        return real_load(addr)

    monkeypatch.setattr(atomics, "store_release", store)
    monkeypatch.setattr(atomics, "load_acquire", load)
    ring = new_ring()
    ring.try_write(b"abc")
    ring.try_read()
    assert calls.count("store") == 2 and calls.count("load") >= 1


def test_atomic_primitives_round_trip() -> None:
    import ctypes

    cell = (ctypes.c_uint64 * 2)()
    addr = ctypes.addressof(cell)
    atomics.store_release(addr, 2**64 - 1)
    assert atomics.load_acquire(addr) == 2**64 - 1 and cell[0] == 2**64 - 1
    atomics.fence()
    with pytest.raises(ValueError, match="aligned"):
        atomics.load_acquire(addr + 1)


def test_weakly_ordered_machines_have_no_plain_python_path() -> None:
    """The ring's only ordering primitives are the compiled ones, on every CPU."""
    from structllm.ipc import _atomic

    assert atomics.store_release is _atomic.store_release
    assert atomics.load_acquire is _atomic.load_acquire
    assert isinstance(atomics.WEAKLY_ORDERED, bool)


def endpoints() -> tuple[Endpoint[ToEngine], Ring]:
    a, b = new_ring(1 << 12), new_ring(1 << 12)
    bell, peer = Doorbell(), Doorbell()
    return Endpoint(a, b, bell, peer, ToEngine), a


def test_garbage_frame_is_a_protocol_error_and_reading_goes_on() -> None:
    ep, inbound = endpoints()
    errors: list[ProtocolError] = []
    ep.on_protocol_error = errors.append
    good = AddRequest("r1", [1, 2], SamplingParams())
    inbound.try_write(b"\xc1garbage")
    inbound.try_write(msgspec.msgpack.encode(["NotAType", 1]))
    inbound.try_write(msgspec.msgpack.encode(good))
    got = ep.try_recv()
    assert got == [good]
    assert ep.protocol_errors == 2 and all("malformed frame" in str(e) for e in errors)


def test_out_of_range_sampling_in_a_frame_is_a_protocol_error() -> None:
    ep, inbound = endpoints()
    ep.on_protocol_error = lambda e: None
    bad = msgspec.msgpack.encode(AddRequest("r", [1], SamplingParams())).replace(
        b"\xcb?\xf0\x00\x00\x00\x00\x00\x00", b"\xcb\xbf\xf0\x00\x00\x00\x00\x00\x00"
    )
    inbound.try_write(bad)  # temperature 1.0 -> -1.0
    assert ep.try_recv() == [] and ep.protocol_errors == 1
