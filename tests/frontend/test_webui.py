"""The chat page's files, in-process: served by an app with no engine attached (serving
``/`` never touches the engine), with or without an API key, and written so that model
text can only ever be text (no HTML sinks in the script, nothing inline for the
content-security policy to block)."""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

import anyio
import pytest

from structllm.server.app import App
from structllm.server.config import ServerConfig
from structllm.tokenizer import Tokenizer

CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()


async def call(
    app: App, method: str, path: str, body: bytes = b""
) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request through the ASGI app; returns status, headers and body."""
    sent: list[dict[str, Any]] = []
    request = {"type": "http.request", "body": body, "more_body": False}

    async def receive() -> dict[str, Any]:
        return request

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": []}
    await app(scope, receive, send)
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_the_page_is_served_without_an_engine(tokenizer: Tokenizer, backend: str) -> None:
    app = App(ServerConfig(api_key="k"), "m", tokenizer)
    assert app.client is None  # no engine attached: generation answers 503

    async def main() -> None:
        status, headers, body = await call(app, "GET", "/")
        assert status == 200 and headers[b"content-type"] == b"text/html; charset=utf-8"
        assert body == (resources.files("structllm") / "web" / "index.html").read_bytes()
        assert (await call(app, "GET", "/ui/app.js"))[0] == 200
        status, _, body = await call(app, "POST", "/v1/chat/completions", CHAT)
        assert status == 401  # the API keeps its key
        app.config.api_key = None
        status, _, body = await call(app, "POST", "/v1/chat/completions", CHAT)
        assert status == 503 and b"the engine is starting" in body

    anyio.run(main, backend=backend)


def test_no_web_ui_leaves_the_routes_out(tokenizer: Tokenizer) -> None:
    app = App(ServerConfig(web_ui=False), "m", tokenizer)

    async def main() -> None:
        status, _, body = await call(app, "GET", "/")
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found"

    anyio.run(main, backend="trio")


def web(name: str) -> str:
    return (resources.files("structllm") / "web" / name).read_text()


def test_the_script_has_no_html_sinks() -> None:
    js = web("app.js")
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "Function(",
    ):
        assert sink not in js, sink


def test_the_page_has_nothing_inline_and_nothing_external() -> None:
    html = web("index.html")
    assert re.findall(r"<script\b[^>]*>", html) == ['<script src="/ui/app.js" defer>']
    assert not re.search(r"\sstyle=|\son[a-z]+=", html)  # inline styles and handlers
    for text in (html, web("app.js"), web("style.css")):
        assert not re.search(r"https?://", text)  # no CDN, nothing fetched from elsewhere
