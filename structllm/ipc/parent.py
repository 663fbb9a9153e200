"""Dying with the parent process (Linux), for the engine and the front-end workers."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


class ParentGone(Exception):
    pass


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits. The signal follows
    the parent *thread* that forked us: parents fork from their main (event-loop) thread.
    Raises ``ParentGone`` if the parent is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise ParentGone
