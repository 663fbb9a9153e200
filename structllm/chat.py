"""``structllm chat``: a streaming terminal chat, like ``ollama run``.

Talks to any OpenAI-compatible server (``--url``), or starts ``structllm run`` on a free
local port for the session and stops it on exit. Ctrl-C during an answer stops that
answer (the connection is closed, so the server aborts the request); Ctrl-D or ``/bye``
ends the chat. ``/image PATH`` (or ``--image PATH``) attaches an image file to the next
message, sent as an ``image_url`` part with a ``data:`` URL (for vision models).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _connect(url: str) -> tuple[http.client.HTTPConnection, str]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=600)
    return conn, u.path.rstrip("/").removesuffix("/v1")


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        conn, base = _connect(url)
        try:
            conn.request("GET", base + "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready in time")


# the formats servers accept for image parts, by their first bytes
_IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def image_part(path: str) -> dict[str, Any]:
    """An ``image_url`` content part holding the file at ``path`` as a ``data:`` URL.
    Raises ``ValueError`` for a file that is not a PNG, JPEG, WebP or GIF image."""
    with open(path, "rb") as f:
        data = f.read()
    mime = next((m for magic, m in _IMAGE_MAGIC if data.startswith(magic)), None)
    if mime is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        mime = "image/webp"
    if mime is None:
        raise ValueError(f"{path} is not a PNG, JPEG, WebP or GIF image")
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


def user_message(text: str, images: list[dict[str, Any]]) -> dict[str, Any]:
    """A user message: plain text, or a list of parts when images are attached."""
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "text", "text": text}, *images]}


def _stream(url: str, api_key: str | None, body: dict[str, Any]) -> Iterator[str]:
    conn, base = _connect(url)
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    try:
        conn.request("POST", base + "/v1/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read().decode(errors='replace')}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    yield text
    finally:
        conn.close()


def chat(a: argparse.Namespace) -> int:
    proc: subprocess.Popen[bytes] | None = None
    url = a.url
    try:
        if url is None:
            port = _free_port()
            cmd = [
                sys.executable,
                "-m",
                "structllm",
                "run",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ]
            if a.model:
                cmd.insert(4, a.model)
            if getattr(a, "mmproj", None):  # a GGUF model's vision tower (llama.cpp's flag)
                cmd += ["--mmproj", a.mmproj]
            print("starting a local server ...", file=sys.stderr)
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, proc, 600)
        messages: list[dict[str, Any]] = (
            [{"role": "system", "content": a.system}] if a.system else []
        )
        images = [image_part(p) for p in a.image]
        print(
            "chat with the model (Ctrl-C stops an answer, /image PATH attaches an image, "
            "Ctrl-D or /bye quits)",
            file=sys.stderr,
        )
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                print()
                return 0
            if line.strip() in ("/bye", "/exit", "/quit"):
                return 0
            if line.startswith("/image "):
                try:
                    images.append(image_part(line[7:].strip()))
                except (OSError, ValueError) as e:
                    print(f"error: {e}", file=sys.stderr)
                continue
            if not line.strip():
                continue
            messages.append(user_message(line, images))
            images = []
            body = {
                "messages": messages,
                "stream": True,
                "temperature": a.temperature,
                "max_tokens": a.max_tokens,
            }
            answer = []
            try:
                for piece in _stream(url, a.api_key, body):
                    answer.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                sys.stdout.write(" [stopped]")
            except (OSError, RuntimeError) as e:
                print(f"\nerror: {e}", file=sys.stderr)
                messages.pop()
                continue
            print()
            messages.append({"role": "assistant", "content": "".join(answer)})
    except (RuntimeError, OSError, ValueError) as e:
        print(f"structllm chat: {e}", file=sys.stderr)
        return 1
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
