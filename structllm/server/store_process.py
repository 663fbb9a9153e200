"""The response store's process: one per front-end process, the only one that runs SQLite.

``python -m structllm.server.store_process LAUNCH_JSON`` (started by
``store_client.AsyncResponseStore`` through ``ipc.spawn``). Why a process and not a
worker thread: sqlite3 lets go of the GIL around each statement and must take it back
afterwards, from a front end whose event loop holds it under load (commits timed in
the thread reached 50 ms at p99 on a loaded 2-vCPU VM). Here SQLite has a GIL of its
own and the front end waits on a socket, holding nothing.

Two connections, each a Unix stream socket inherited from the front end and served by
its own thread with its own SQLite connection (WAL: reads do not wait for writes):
``write_fd`` (puts, deletes, cancels) and ``read_fd`` (gets). Frames are a 4-byte
little-endian length and a msgpack ``StoreCall``; each is answered by one
``StoreReply`` in order. The process exits when the write socket reaches EOF (its
front end closed it, or died: it also dies with its parent, ``ipc.parent``). A
failure to open the file is every call's ``error``, not an exit, so the front end can
say what is wrong.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sqlite3
import sys
import threading
import time

import msgspec

from structllm.ipc.parent import ParentGone, die_with_parent
from structllm.protocol import (
    StoreCall,
    StoreCancel,
    StoreDelete,
    StoreGet,
    StoreLaunch,
    StorePut,
    StoreReply,
)
from structllm.server.response_store import ResponseStore

HEADER = 4  # bytes of a frame's length (little-endian)


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEADER, "little") + payload


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None at EOF."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def answer(store: ResponseStore, call: StoreCall) -> StoreReply:
    """Run one call; its time in SQLite (the transaction, no encoding) in ``took_ns``."""
    t = time.perf_counter_ns()
    if isinstance(call, StorePut):
        store.put_rows(call.rows)
        return StoreReply(time.perf_counter_ns() - t)
    if isinstance(call, StoreGet):
        row = store.get_row(call.response_id)
        return StoreReply(time.perf_counter_ns() - t, row=row)
    if isinstance(call, StoreDelete):
        deleted = store.delete(call.response_id)
        return StoreReply(time.perf_counter_ns() - t, deleted=deleted)
    assert isinstance(call, StoreCancel)
    row = store.request_cancel_row(call.response_id)
    return StoreReply(time.perf_counter_ns() - t, row=row)


def serve(store: ResponseStore | str, sock: socket.socket) -> None:
    """Answer the calls on ``sock`` until EOF. ``store`` is a message when the file could
    not be opened: every call's error. A broken socket (the front end gone) ends it too."""
    with contextlib.suppress(OSError):
        _serve(store, sock)


def _serve(store: ResponseStore | str, sock: socket.socket) -> None:
    decoder = msgspec.msgpack.Decoder(StoreCall)
    encoder = msgspec.msgpack.Encoder()
    while True:
        header = _recv_exactly(sock, HEADER)
        if header is None:
            return
        payload = _recv_exactly(sock, int.from_bytes(header, "little"))
        if payload is None:
            return
        received = time.perf_counter_ns()
        call = decoder.decode(payload)
        if isinstance(store, str):
            reply = StoreReply(0, error=store)
        else:
            try:
                reply = answer(store, call)
            except sqlite3.Error as e:  # the front end raises it to the caller
                reply = StoreReply(0, error=f"{type(e).__name__}: {e}")
        stamped = msgspec.structs.replace(
            reply, received_ns=received, replied_ns=time.perf_counter_ns()
        )
        sock.sendall(frame(encoder.encode(stamped)))


def _open(launch: StoreLaunch) -> ResponseStore | str:
    try:
        return ResponseStore(launch.path, launch.max_bytes, launch.ttl)
    except (sqlite3.Error, OSError) as e:
        return f"cannot open the response store {launch.path!r}: {type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the front end decides
    if len(argv) != 1:
        print("usage: python -m structllm.server.store_process LAUNCH_JSON", file=sys.stderr)
        return 2
    launch = msgspec.json.decode(argv[0], type=StoreLaunch)
    try:
        die_with_parent(launch.parent_pid)
    except ParentGone:
        return 0
    write_sock = socket.socket(fileno=launch.write_fd)
    read_sock = socket.socket(fileno=launch.read_fd)
    writer = _open(launch)  # first: it makes the file and its schema
    reader = _open(launch) if isinstance(writer, ResponseStore) else writer
    # the reads' thread ends with the process (daemon): the write socket's EOF ends both
    threading.Thread(target=serve, args=(reader, read_sock), daemon=True).start()
    try:
        serve(writer, write_sock)
    finally:
        write_sock.close()
        if isinstance(writer, ResponseStore):
            writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
