"""The chat page's files over plain HTTP on a real server (the null model: only the
front end matters here): content types, no API key needed for them while the API still
needs it, and ``--no-web-ui``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support.server import Server

KEY = "http-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # the key is passed as an argument, not through Server(api_key=...), which would
    # send it with every request
    with Server("--null-model", "--api-key", KEY) as s:
        yield s
        assert s.stop() == 0


def headers(server: Server, path: str, **kw: str) -> tuple[int, dict[str, str], bytes]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("GET", path, headers=kw)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("path", "ctype", "marker"),
    [
        ("/", "text/html; charset=utf-8", b'<script src="/ui/app.js"'),
        ("/ui/app.js", "text/javascript; charset=utf-8", b"/v1/chat/completions"),
        ("/ui/style.css", "text/css; charset=utf-8", b"#messages"),
    ],
)
def test_the_page_is_served_without_the_key(
    server: Server, path: str, ctype: str, marker: bytes
) -> None:
    status, h, body = headers(server, path)
    assert status == 200
    assert h["content-type"] == ctype
    assert int(h["content-length"]) == len(body) and marker in body
    assert h["x-content-type-options"] == "nosniff"
    assert "script-src 'self'" in h["content-security-policy"]


def test_the_api_still_needs_the_key(server: Server) -> None:
    for path in ("/v1/models", "/metrics"):
        status, _, body = headers(server, path)
        assert status == 401, path
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        assert headers(server, path, **AUTH)[0] == 200
    status, _ = server.post("/v1/chat/completions", {"messages": []})
    assert status == 401
    # only the page's own files are there
    assert headers(server, "/ui/other.js")[0] == 404


def test_the_page_only_answers_get(server: Server) -> None:
    status, body = server.post("/", {}, headers=AUTH)
    assert status == 405 and "not allowed" in body["error"]["message"]


def test_no_web_ui_turns_the_page_off() -> None:
    with Server("--null-model", "--no-web-ui") as s:
        for path in ("/", "/ui/app.js", "/ui/style.css"):
            status, body = s.get(path)
            assert status == 404, path
            assert json.loads(body)["error"]["code"] == "not_found"
        assert s.get("/v1/models")[0] == 200
        assert s.stop() == 0
