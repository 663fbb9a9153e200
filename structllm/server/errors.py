"""The errors a request handler raises to end its request."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered with OpenAI's error JSON and ``status`` (before the response
    has begun) or as an error event in the stream (after)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.headers = headers or []

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class ClientGone(Exception):
    """The client disconnected before its request was read: there is nobody to answer."""


def overloaded(requests: int, tokens: int) -> APIError:
    return APIError(
        503,
        f"the server is overloaded ({requests} requests with {tokens} prompt tokens are queued); "
        "retry later",
        type="service_unavailable",
        code="overloaded",
        headers=[(b"retry-after", b"1")],
    )
