"""A keep-alive connection stays usable after a response that did not need the request's
body (a GET with a body, a 404, a 405): the server reads the rest of the body before it
answers, so the client's next request on the same connection is answered, not dropped
(hypercorn closes a connection whose request body was left unread)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.support.server import Server, read_until


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server() as s:
        yield s


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/models", b"200"), ("POST", "/v1/nowhere", b"404"), ("PUT", "/v1/models", b"405")],
)
def test_the_next_request_on_the_connection_is_answered(
    server: Server, method: str, path: str, status: bytes
) -> None:
    body = b'{"unread": true}'
    with socket.create_connection(("127.0.0.1", server.port)) as c:
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        c.sendall(head.encode())
        time.sleep(0.05)  # the body after the headers: the handler may answer before it
        c.sendall(body)
        first = read_until(c, b"}", timeout=30)
        assert first.startswith(b"HTTP/1.1 " + status), first[:80]
        assert b"connection: close" not in first.lower()
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        second = read_until(c, b"\r\n\r\n", timeout=30)
        assert second.startswith(b"HTTP/1.1 200"), second[:80]


def test_a_body_too_large_to_read_closes_the_connection_saying_so(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as c:
        size = 8 << 20  # past what an unneeded body is read for (body.DRAIN_BYTES)
        head = f"PUT /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n"
        # sent beside the read: the server stops reading past 1 MiB and answers, and a
        # send it no longer reads may block, or fail once it closes (that is fine)
        sender = threading.Thread(target=_send_quietly, args=(c, head.encode() + b" " * (2 << 20)))
        sender.start()
        try:
            first = read_until(c, b"}", timeout=30)
        finally:
            # unblocks the sender; the server may have reset the connection already
            # (its unread bytes make its close a reset), which is ENOTCONN here
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            sender.join()
        assert first.startswith(b"HTTP/1.1 405") and b"connection: close" in first.lower()


def _send_quietly(c: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        c.sendall(data)
