"""A real ``structllm run`` subprocess on a free port, and helpers to poke it: request
bodies, raw-socket streams (to disconnect at will) and their server-sent events."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.support.procs import HANG_S, ROOT, engine_of


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(
        self,
        *args: str,
        backend: str = "trio",
        startup: float = 180.0,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        stderr: Path | None = None,
    ) -> None:
        self.api_key = api_key
        self.stderr = stderr  # a file the server's stderr goes to (else: inherited)
        self.host = host
        self.env = None if env is None else {**os.environ, **env}
        if api_key:
            args = (*args, "--api-key", api_key)
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.args = [
            "--host",
            host,
            "--port",
            str(self.port),
            "--backend",
            backend,
            "--log-level",
            "warning",
            *args,
        ]
        self.startup = startup
        self.proc: subprocess.Popen[bytes] | None = None
        self.engine_pid = -1

    def __enter__(self) -> Server:
        err = None if self.stderr is None else self.stderr.open("wb")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "structllm", "run", *self.args],
                cwd=ROOT,
                env=self.env,
                stderr=err,
            )
        finally:
            if err is not None:
                err.close()  # the child has its own copy
        end = time.monotonic() + self.startup
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}"
            try:
                if self.get("/health")[0] == 200:
                    self.engine_pid = engine_of(self.proc.pid)
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError("server did not become healthy")

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = HANG_S) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
        timeout: float = 120,
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = (
                raw
                if raw is not None
                else (json.dumps(body).encode() if body is not None else None)
            )
            auth = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            conn.request(
                method, path, data, {"content-type": "application/json", **auth, **(headers or {})}
            )
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def get(self, path: str, **kw: Any) -> tuple[int, bytes]:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        status, data = self.request("POST", path, body, **kw)
        try:
            return status, json.loads(data)
        except ValueError:
            return status, data

    def metric(self, name: str) -> float:
        _, text = self.get("/metrics")
        m = re.search(rf"^structllm:{name}{{[^}}]*}} (\S+)$", text.decode(), re.M)
        assert m, f"metric {name} missing"
        return float(m.group(1))

    def wait_idle(self, timeout: float = HANG_S) -> None:
        """Until no request is running or waiting and the KV cache is empty (``timeout``
        only guards against a hang: how fast it gets there is not asserted)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if (
                self.metric("num_requests_running"),
                self.metric("num_requests_waiting"),
                self.metric("kv_cache_usage_perc"),
            ) == (0, 0, 0):
                return
            time.sleep(0.05)
        raise AssertionError(
            f"not idle: running={self.metric('num_requests_running')} "
            f"waiting={self.metric('num_requests_waiting')} "
            f"kv={self.metric('kv_cache_usage_perc')}"
        )


def open_stream(
    port: int, path: str, body: dict[str, Any], host: str = "127.0.0.1"
) -> socket.socket:
    """Send a request on a raw socket (to disconnect at will); returns the socket."""
    data = json.dumps(body).encode()
    s = socket.create_connection((host, port))
    s.sendall(
        (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        + data
    )
    return s


def read_until(s: socket.socket, marker: bytes, limit: int = 1 << 20, timeout: float = 60) -> bytes:
    s.settimeout(timeout)
    buf = b""
    while marker not in buf and len(buf) < limit:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


def completion(prompt: str, max_tokens: int, stream: bool = False, **kw: Any) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body that generates exactly ``max_tokens`` tokens."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": True,
        **kw,
    }


def sse_text(raw: bytes) -> str:
    """The text of a streamed completion or chat completion (all choices, in order)."""
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            out += [
                c.get("text") or c.get("delta", {}).get("content") or ""
                for c in chunk.get("choices", [])
            ]
    return "".join(out)
