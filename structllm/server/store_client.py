"""The front end's side of the response store: ``AsyncResponseStore``.

Every call goes to this front end's store process (``store_process``, spawned on first
use, owned here, closed by ``close``) over one of two Unix sockets, one call in flight
per socket: writes (with deletes and cancels) and reads, each on its own SQLite
connection there. The front end encodes and decodes the rows' JSON (msgspec); it awaits
the reply on the socket (``anyio.wait_readable``), holding neither the GIL nor a thread
while SQLite works.

Writes commit in groups: a ``put`` that finds no write in flight leads: it sends every
pending row in one ``StorePut`` (one transaction) and hands the lead to a task whose row
came meanwhile (the rows of tasks cancelled while waiting are written all the same); the
others wait for their group's commit. So N responses ending in the same engine step
cost one or two commits, not N in a queue.

A round trip is shielded from cancellation (a reply left unread would be the next
call's) and bounded (``CALL_TIMEOUT_S``). If the process is gone (EOF, a broken socket)
or does not answer in time, the call raises ``StoreUnavailable`` naming what happened,
the process is killed and reaped, and the next call starts a new one on the same file.
SQLite's own errors come back as ``StoreError``. Both are ``APIError``s (503, OpenAI's
error JSON, or an error event when the stream has begun).

``observe(kind, seconds)`` gets, per call: ``write``/``read``, the time in SQLite as the
store process measured it (``StoreReply.took_ns``); ``write_trip``, a commit's round trip
as its leader saw it, made of ``write_send`` (from the frame's send until the store
process had read it: its turn on a CPU), ``write`` and ``write_resume`` (from the
reply's send until the leader runs again: the event loop's turn); ``write_wait``/
``read_wait``, the call as its request waited for it (for a write, also the group
before its own). The stamps are ``perf_counter_ns`` in both processes (one clock).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from structllm.ipc.spawn import Child, spawn
from structllm.protocol import (
    StoreCall,
    StoreCancel,
    StoreDelete,
    StoreGet,
    StoreLaunch,
    StorePut,
    StoreReply,
    StoreRow,
)
from structllm.server import store_process
from structllm.server.errors import APIError
from structllm.server.response_store import Stored, decode_row, encode_row
from structllm.server.store_process import HEADER, frame

CALL_TIMEOUT_S = 60.0  # > SQLite's busy timeout (30 s), which a call may wait out
CLOSE_WAIT_S = 5.0  # close: how long the process may take to finish its call and exit


class StoreError(APIError):
    """A store call failed (SQLite's error, or the process's): a 503 for its request."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, type="service_unavailable", code="store_unavailable")


class StoreUnavailable(StoreError):
    """The store process is gone or did not answer; the next call starts a new one."""


async def _recv(sock: socket.socket, n: int) -> bytes:
    import anyio

    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except BlockingIOError:
            await anyio.wait_readable(sock)
            continue
        if k == 0:
            raise EOFError("it closed its end of the socket")
        got += k
    return bytes(buf)


async def _round_trip(sock: socket.socket, payload: bytes) -> bytes:
    """Send one frame, receive one (non-blocking socket)."""
    import anyio

    data = memoryview(frame(payload))
    while data:
        try:
            data = data[sock.send(data) :]
        except BlockingIOError:
            await anyio.wait_writable(sock)
    header = await _recv(sock, HEADER)
    return await _recv(sock, int.from_bytes(header, "little"))


@dataclass(eq=False)
class _Put:
    """One ``put`` waiting for its commit. ``wake`` is set when it is done or when its
    task is to lead the next group (``lead``)."""

    row: StoreRow
    wake: Any  # anyio.Event
    done: bool = False
    lead: bool = False
    gone: bool = False  # its task was cancelled while waiting (its row is still written)
    error: Exception | None = None


class AsyncResponseStore:
    """The store at ``path`` for one front-end process, through its store process."""

    def __init__(
        self,
        path: str | Path,
        max_bytes: int,
        ttl: float,
        observe: Callable[[str, float], None] | None = None,
    ) -> None:
        self.path, self.max_bytes, self.ttl = Path(path), max_bytes, ttl
        self.observe = observe or (lambda _kind, _s: None)
        self._child: Child | None = None
        self._socks: dict[str, socket.socket] = {}  # "write", "read": this end of each
        self._locks: dict[str, Any] = {}  # anyio.Lock per socket: one call in flight
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StoreReply)
        self._pending: list[_Put] = []
        self._writing = False  # a task leads a group now (or has been handed the lead)

    @property
    def pid(self) -> int | None:
        """The store process's pid (None before the first call or after a failure)."""
        return None if self._child is None else self._child.pid

    # -- the process -------------------------------------------------------------------

    def _start(self) -> None:
        """Spawn the store process (fork+exec from this, the event loop's, thread, as
        ``spawn`` wants), one socket pair per connection; its ends are closed here once
        it has them."""
        with contextlib.ExitStack() as theirs, contextlib.ExitStack() as ours:
            socks: dict[str, socket.socket] = {}
            fds: dict[str, int] = {}
            for name in ("write", "read"):
                mine, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                ours.callback(mine.close)
                theirs.callback(other.close)
                mine.setblocking(False)
                socks[name], fds[name] = mine, other.fileno()
            launch = StoreLaunch(
                str(self.path), self.max_bytes, self.ttl, os.getpid(), fds["write"], fds["read"]
            )
            self._child = spawn(store_process.__name__, launch, pass_fds=list(fds.values()))
            ours.pop_all()  # kept: the sockets are this object's now
            self._socks = socks

    def _stop(self, child: Child) -> None:
        """Kill and reap ``child`` and close its sockets, unless it was replaced already
        (the other connection's call found it gone first)."""
        if self._child is not child:
            return
        import anyio

        self._child = None
        socks, self._socks = self._socks, {}
        for sock in socks.values():
            anyio.notify_closing(sock)  # a call waiting on it raises ClosedResourceError
            sock.close()
        child.close()

    async def _call(self, conn: str, call: StoreCall) -> StoreReply:
        """One round trip on connection ``conn``; raises ``StoreError`` for an error reply."""
        import anyio

        if conn not in self._locks:
            self._locks[conn] = anyio.Lock()
        async with self._locks[conn]:
            if self._child is None:
                try:
                    self._start()
                except OSError as e:  # out of descriptors or processes
                    raise StoreUnavailable(f"cannot start the response store process: {e}") from e
            child = self._child
            assert child is not None
            payload = self._encoder.encode(call)
            why = f"did not answer within {CALL_TIMEOUT_S:g} s"
            with anyio.CancelScope(shield=True), anyio.move_on_after(CALL_TIMEOUT_S):
                try:
                    reply = self._decoder.decode(await _round_trip(self._socks[conn], payload))
                except (OSError, EOFError, anyio.ClosedResourceError) as e:
                    why = str(e) or type(e).__name__
                else:
                    if reply.error is not None:
                        raise StoreError(f"the response store failed: {reply.error}")
                    return reply
            pid = child.pid
            self._stop(child)
            raise StoreUnavailable(
                f"the response store process (pid {pid}) {why}; "
                f"it is restarted on the next call, on the same file"
            )

    def close(self) -> None:
        """Close the sockets (the process exits at their EOF, after its current call),
        then reap it (killed if it takes longer than ``CLOSE_WAIT_S``). Idempotent."""
        child, socks = self._child, self._socks
        self._child, self._socks = None, {}
        for sock in socks.values():
            sock.close()
        if child is not None:
            try:
                child.wait(CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
            finally:
                child.close()

    # -- writes ------------------------------------------------------------------------

    async def put(
        self,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        engine_request_id: str | None = None,
        owner_pid: int | None = None,
        events: list[dict[str, Any]] | None = None,
    ) -> None:
        import anyio

        start = time.perf_counter()
        row = encode_row(response, conversation, engine_request_id, owner_pid, events)
        w = _Put(row, anyio.Event())
        self._pending.append(w)
        try:
            if self._writing:
                await w.wake.wait()
            else:
                self._writing = w.lead = True
        finally:
            if w.lead and not w.done:  # cancelled or not, a leader writes its group
                with anyio.CancelScope(shield=True):
                    await self._write_groups()
            elif not w.done:
                w.gone = True
        if w.error is not None:
            raise w.error
        self.observe("write_wait", time.perf_counter() - start)

    async def _write_groups(self) -> None:
        """Commit the pending rows, group after group, until a waiting task can take the
        lead or none is left."""
        handed = False
        try:
            while self._pending and not handed:
                group, self._pending = self._pending, []
                try:
                    sent = time.perf_counter_ns()
                    reply = await self._call("write", StorePut([w.row for w in group]))
                    resumed = time.perf_counter_ns()
                    self.observe("write_trip", (resumed - sent) * 1e-9)
                    self.observe("write_send", (reply.received_ns - sent) * 1e-9)
                    self.observe("write", reply.took_ns * 1e-9)
                    self.observe("write_resume", (resumed - reply.replied_ns) * 1e-9)
                except StoreError as e:  # each waiter raises it
                    for w in group:
                        w.error = e
                for w in group:
                    w.done = True
                    w.wake.set()
                nxt = next((w for w in self._pending if not w.gone), None)
                if nxt is not None:
                    nxt.lead = handed = True
                    nxt.wake.set()
        finally:
            if not handed:
                self._writing = False

    async def delete(self, response_id: str) -> bool:
        return (await self._call("write", StoreDelete(response_id))).deleted

    async def request_cancel(self, response_id: str) -> Stored | None:
        """Mark a background run as to be cancelled; the row as it is then."""
        row = (await self._call("write", StoreCancel(response_id))).row
        return None if row is None else decode_row(row)

    # -- reads -------------------------------------------------------------------------

    async def get(self, response_id: str) -> Stored | None:
        start = time.perf_counter()
        reply = await self._call("read", StoreGet(response_id))
        found = None if reply.row is None else decode_row(reply.row)
        self.observe("read", reply.took_ns * 1e-9)
        self.observe("read_wait", time.perf_counter() - start)
        return found
