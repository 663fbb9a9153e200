"""Steps to ranks on other hosts: length-prefixed msgpack frames over one TCP connection
per remote rank (the shared-memory broadcast ring, ``broadcast_channel``, stays for the
ranks on rank 0's host).

Rank 0 listens on its node's address, publishes that address in the process group's
store, and accepts one connection per remote rank (the rank says who it is in its first
4 bytes). Every wait is bounded:

- rank 0's sends carry a socket timeout (a rank that stops reading fails the step);
- both ends set TCP keepalive, so a host that vanishes without closing its connection
  is noticed within ``KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S``;
- a remote rank waits for its next step in slices of ``IDLE_POLL_S``, and an EOF (rank
  0 gone, or it closed the connection to stop the rank) ends the wait at once.

A remote rank sends nothing after its hello, so its socket turning readable on rank 0's
side means it closed (or died): ``StepSender.dead`` is how rank 0 notices.
"""

from __future__ import annotations

import select
import socket
import struct
from collections.abc import Callable

HEADER = struct.Struct("<I")  # frame length
HELLO = struct.Struct("<I")  # the connecting rank
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_COUNT = 3
IDLE_POLL_S = 1.0


class StreamClosed(ConnectionError):
    """The other end of a step stream closed it or went away."""


def keepalive(sock: socket.socket) -> None:
    """Probe an idle connection so a peer whose host vanished is noticed (bounded)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def read_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes (under the socket's timeout); ``StreamClosed`` at EOF."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise StreamClosed("the step stream was closed")
        buf += chunk
    return bytes(buf)


class StepSender:
    """Rank 0's end of the connection to one remote rank."""

    def __init__(self, sock: socket.socket, rank: int, timeout: float) -> None:
        self.sock = sock
        self.rank = rank
        sock.settimeout(timeout)
        keepalive(sock)

    def send(self, frame: bytes) -> None:
        """One frame; raises ``OSError`` (``TimeoutError`` included) if the rank is gone
        or stopped reading for the whole timeout."""
        self.sock.sendall(HEADER.pack(len(frame)) + frame)

    def dead(self) -> bool:
        """Whether the rank closed its end (it never sends after its hello)."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        if not readable:
            return False
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()


def connect(addr: str, rank: int, timeout: float) -> socket.socket:
    """A remote rank's connection to rank 0's step listener at ``host:port``."""
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    keepalive(sock)
    sock.sendall(HELLO.pack(rank))
    return sock


def recv_frame(sock: socket.socket, idle: Callable[[], None], timeout: float) -> bytes:
    """The next frame: waits without bound while the connection is alive and idle,
    calling ``idle`` every ``IDLE_POLL_S``; once a frame has begun, the rest must arrive
    within ``timeout``. ``StreamClosed`` at EOF."""
    while True:
        readable, _, _ = select.select([sock], [], [], IDLE_POLL_S)
        if readable:
            break
        idle()
    sock.settimeout(timeout)
    (n,) = HEADER.unpack(read_exact(sock, HEADER.size))
    return read_exact(sock, n)
