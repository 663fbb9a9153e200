"""Processes and shared memory as ``/proc`` and ``/dev/shm`` show them, and waiting
without timing assertions."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
# How long a test waits for something that must happen before calling it a hang. Not a
# speed requirement: on a loaded machine every step may be several times slower, and
# loading the model again (an engine restart) took over a minute on one.
HANG_S = 180.0


def wait_for(
    condition: Callable[[], bool], message: str = "condition never held", timeout: float = HANG_S
) -> None:
    """Poll ``condition`` until it holds. ``timeout`` only guards against a hang: tests
    assert what happens (counted in engine steps or events), not how fast."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, message
        time.sleep(0.02)


def python_env() -> dict[str, str]:
    """The environment of a child process that imports ``tests`` and ``structllm`` from
    this checkout."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def children(pid: int) -> list[int]:
    """Live child processes of ``pid``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(name))
    return out


def engine_of(pid: int) -> int:
    """The engine child of a server process (-1 if none)."""
    for kid in children(pid):
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as f:
                if b"structllm.engine" in f.read():
                    return kid
        except FileNotFoundError:
            pass
    return -1


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def open_files(pid: int) -> list[str]:
    """What the descriptors of a live process point at. A descriptor closed between the
    listing and its ``readlink`` (the process is running) is skipped."""
    out = []
    for n in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            out.append(os.readlink(f"/proc/{pid}/fd/{n}"))
    return out


def shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("structllm-")}
