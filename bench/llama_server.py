"""llama.cpp's ``llama-server`` for the benches: started on a free loopback port, polled
on ``/health`` until it serves, stopped on the way out (one copy of that loop instead of
one per bench).

    from llama_server import LlamaServer          # (bench/ is the script's own folder)

    with LlamaServer(binary, model, ["-np", "16", "-c", "8192"], threads=2) as server:
        post(server.url + "/completion", ...)     # server.proc.pid: its memory, CPU time

The flags passed are ``-m MODEL --host 127.0.0.1 --port P``, then ``threads`` as
``-t N -tb N`` (None: neither, llama-server's default of one per core), then ``args``
as given (``--lora``, ``-np``, ``-c``, ``--log-disable``, ...). Its stdout and stderr go
to an unnamed temporary file, whose tail is the error (``LlamaServerFailed``) when it
exits before it is healthy or is not healthy in ``timeout`` seconds. ``launch()`` does
what entering does (for a bench that stops it itself: ``stop()``); ``start`` and
``wait_healthy`` apart let a bench start it beside another server and wait for both.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, NoReturn

HOST = "127.0.0.1"


class LlamaServerFailed(RuntimeError):
    """llama-server exited early or never became healthy; the message ends with the tail
    of its output."""


def free_port(host: str = HOST) -> int:
    """A port nothing listens on now (the OS's pick for a bind to port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One llama-server process; a context manager (started and healthy inside the
    ``with``, terminated, then killed if it lingers, on the way out)."""

    def __init__(
        self,
        binary: str | Path,
        model: str | Path,
        args: Sequence[str] = (),
        *,
        threads: int | None = None,
        timeout: float = 900.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.cmd = [str(binary), "-m", str(model), "--host", HOST, "--port", str(self.port)]
        if threads is not None:
            self.cmd += ["-t", str(threads), "-tb", str(threads)]
        self.cmd += list(args)
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "llama-server not started"
        return self.proc.pid

    def start(self) -> LlamaServer:
        """Starts the process (not waiting for it); ``self``."""
        if not Path(self.cmd[0]).is_file():
            raise LlamaServerFailed(f"no llama-server binary at {self.cmd[0]}")
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (outlives this call: stop() closes it)
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        except OSError as e:  # (not executable, wrong architecture)
            self.stop()
            raise LlamaServerFailed(f"cannot run {self.cmd[0]}: {e}") from e
        return self

    def wait_healthy(self) -> None:
        """Returns once ``/health`` answers 200; ``LlamaServerFailed`` (the server stopped)
        if the process exits first or ``timeout`` passes."""
        assert self.proc is not None, "llama-server not started"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"exited with status {self.proc.returncode} before it was healthy")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:  # (not listening yet, or 503 while the model loads)
                pass
            time.sleep(0.2)
        self._fail(f"not healthy after {self.timeout:.0f} s")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; the output file closed. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def output_tail(self, n: int = 2000) -> str:
        """The last ``n`` characters of its stdout and stderr so far."""
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0, 2)
        size = self._log.tell()
        self._log.seek(max(0, size - n))
        return self._log.read().decode(errors="replace")

    def _fail(self, what: str) -> NoReturn:
        tail = self.output_tail().strip() or "(no output: --log-disable keeps it quiet)"
        self.stop()
        raise LlamaServerFailed(f"llama-server {what}: {' '.join(self.cmd)}\n{tail}")

    def launch(self) -> LlamaServer:
        """``start`` and ``wait_healthy``, stopped again if either fails; ``self``."""
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> LlamaServer:
        return self.launch()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
