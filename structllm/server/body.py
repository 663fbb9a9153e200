"""A request's body as the app receives it, and what is left of it when the app has
answered without reading it (a GET with a body, a 404, a 405, a 401 before the body is
looked at).

HTTP/1.1 can reuse a connection only once the request's body has been read off it.
When an app returns with the body unread, hypercorn closes the connection, and a
keep-alive client (httpx, requests, the ``openai`` client) whose next request is already
on its way gets "server disconnected" instead of an answer (seen under load: a fuzzer's
GET with a body, then its next request on the same connection). ``drain`` reads the rest
(bounded in bytes and time) before the response starts, so the connection stays usable.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio

from structllm.server.errors import APIError, ClientGone

Message = MutableMapping[str, Any]

# what is read of a body left unread (beyond it, or slower: the connection closes)
DRAIN_BYTES, DRAIN_SECONDS = 1 << 20, 5.0


class TrackedReceive:
    """``receive`` that remembers whether the body has been read to its end (or the
    client has gone)."""

    def __init__(self, receive: Callable[[], Awaitable[Message]]) -> None:
        self._receive = receive
        self.done = False

    async def __call__(self) -> Message:
        msg = await self._receive()
        if msg["type"] == "http.disconnect" or not msg.get("more_body", False):
            self.done = True
        return msg

    async def drain(self, max_bytes: int = DRAIN_BYTES, timeout: float = DRAIN_SECONDS) -> bool:
        """Read and drop what is left of the body, up to ``max_bytes`` within
        ``timeout`` seconds; False past either (the connection must then close)."""
        size = 0
        with anyio.move_on_after(timeout):
            while not self.done:
                size += len((await self()).get("body", b""))
                if size > max_bytes:
                    return False
        return self.done

    def sender(
        self, send: Callable[[Message], Awaitable[None]]
    ) -> Callable[[Message], Awaitable[None]]:
        """``send`` that, before a response starts, reads what is left of the body (once
        the response has begun, hypercorn no longer hands it over), or else marks the
        response ``Connection: close``."""

        async def wrapped(message: Message) -> None:
            starts = message["type"] == "http.response.start"
            if starts and not self.done and not await self.drain():
                close = (b"connection", b"close")
                message = {**message, "headers": [*message.get("headers", []), close]}
            await send(message)

        return wrapped


async def read_body(
    receive: Callable[[], Awaitable[Message]], max_bytes: int, timeout: float
) -> bytes:
    """The whole body, within ``max_bytes`` (else 413) and ``timeout`` seconds (else 408:
    a client that sends slowly does not hold a request forever)."""
    with anyio.move_on_after(timeout) as scope:
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                raise APIError(413, f"request body exceeds {max_bytes} bytes")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)
    assert scope.cancelled_caught
    raise APIError(408, f"the request body did not arrive within {timeout:.0f}s")
