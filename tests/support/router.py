"""A real ``vllm-router`` (the PyPI package's Rust binary) in front of ``structllm run``
replicas, for the tests and ``bench/scale_out.py``."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.support.procs import HANG_S
from tests.support.server import free_port


def router_binary() -> str | None:
    """The ``vllm-router`` launcher next to this interpreter (the venv's), else on PATH."""
    here = Path(sys.executable).with_name("vllm-router")
    return str(here) if here.exists() else shutil.which("vllm-router")


class Router:
    """``vllm-router --worker-urls ...`` on 127.0.0.1. Health checks every second, one
    failure marks a replica unhealthy: a dead replica leaves the rotation at the first
    check after it dies (the tests wait for that event, not for a duration). ``api_key``:
    the replicas' key, which ``request`` sends as the client's (the router passes the
    client's ``Authorization`` on for some routes, its own ``--api-key`` for others)."""

    def __init__(
        self,
        worker_urls: list[str],
        policy: str = "cache_aware",
        *extra: str,
        api_key: str | None = None,
    ) -> None:
        binary = router_binary()
        assert binary is not None, "vllm-router is not installed (pip install vllm-router)"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            binary,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--policy",
            policy,
            "--worker-urls",
            *worker_urls,
            "--health-check-interval-secs",
            "1",
            "--health-failure-threshold",
            "1",
            "--health-check-timeout-secs",
            "5",
            "--worker-startup-check-interval",
            "1",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",  # its own (the default, 29000, is one per machine)
            str(free_port()),
            "--log-level",
            "warning",
            *extra,
        ]
        if api_key is not None:
            self.args += ["--api-key", api_key]
        self.api_key = api_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.workers = len(worker_urls)

    def __enter__(self) -> Router:
        # the router waits for every worker to be healthy before it listens
        self.proc = subprocess.Popen(self.args, env={**os.environ, "RUST_LOG": "warn"})
        end = time.monotonic() + HANG_S
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"router exited with {self.proc.returncode}"
            try:
                if self.readiness().get("healthy_workers") == self.workers:
                    return self
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError("router did not become ready")

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=HANG_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def request(
        self, method: str, path: str, raw: bytes | None = None, timeout: float = 120
    ) -> tuple[int, bytes, str]:
        """(status, body, content type)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            auth = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            conn.request(method, path, raw, {"content-type": "application/json", **auth})
            resp = conn.getresponse()
            return resp.status, resp.read(), resp.getheader("content-type") or ""
        finally:
            conn.close()

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        status, data, _ = self.request("POST", path, json.dumps(body).encode())
        try:
            return status, json.loads(data)
        except ValueError:
            return status, data

    def readiness(self) -> dict[str, Any]:
        """The router's own view: ``healthy_workers`` of ``total_workers``."""
        _, data, _ = self.request("GET", "/readiness", timeout=10)
        out: dict[str, Any] = json.loads(data)
        return out
