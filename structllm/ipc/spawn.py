"""Starting a Python child process: the one way structllm spawns one.

``spawn(module, launch, pass_fds)`` runs ``python -m MODULE LAUNCH_JSON`` by fork+exec
from the calling thread, with stdin closed, only ``pass_fds`` inherited, and the
directory this ``structllm`` was imported from first on ``PYTHONPATH`` (so both ends run
the same code even when a checkout shadows an installed copy). Not ``anyio.open_process``:
trio forks from a worker thread, and a child's ``PR_SET_PDEATHSIG`` fires when the
*thread* that forked it exits, which trio's thread cache does after a few idle seconds.

Ownership: the returned ``Child`` owns the process and its pidfd from the moment
``spawn`` returns, and whoever called ``spawn`` owns the ``Child``: they ``close`` it in
a ``finally`` (kill if still running, reap, close the pidfd). If ``spawn`` raises,
nothing is left behind. Synchronous: the engine uses it too (the front end awaits exits
through ``async_process``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

from structllm.threads import omp_wait_defaults

_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding this structllm


class Child:
    """A process started by ``spawn`` and its pidfd (readable once the process exits)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid
        try:
            self.pidfd = os.pidfd_open(popen.pid)
        except BaseException:  # (EMFILE, ...) nobody else would stop and reap the child
            popen.kill()
            popen.wait()
            raise

    @property
    def returncode(self) -> int | None:
        """The exit code once it has exited (reaping it), else None."""
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Block until it exits; raises ``subprocess.TimeoutExpired`` after ``timeout``."""
        return int(self.popen.wait(timeout))

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    def describe_exit(self) -> str:
        rc = self.popen.poll()
        if rc is None:
            return "is still running"
        if rc < 0:
            return f"was killed by signal {signal.Signals(-rc).name}"
        return f"exited with code {rc}"

    def close(self) -> None:
        """Kill it if it still runs, reap it, close the pidfd. Idempotent."""
        self.kill()
        self.popen.wait()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def spawn(module: str, launch: msgspec.Struct, pass_fds: Sequence[int] = ()) -> Child:
    """Start ``python -m module`` with ``launch`` as JSON, its one argument."""
    env = dict(os.environ)
    omp_wait_defaults(env)  # the engine and its workers run torch's OpenMP pool
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    popen = subprocess.Popen(
        [sys.executable, "-m", module, msgspec.json.encode(launch).decode()],
        pass_fds=tuple(pass_fds),
        stdin=subprocess.DEVNULL,
        env=env,
    )
    return Child(popen)
