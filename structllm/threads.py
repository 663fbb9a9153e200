"""How the engine's OpenMP threads wait, set before torch (and its libgomp) loads.

torch's CPU kernels run on libgomp's thread pool. A thread that reaches a barrier
first spins there (by default for up to ~300,000 iterations) before it sleeps. On a
machine whose cores are shared (two cores, with the front end, the clients or other work
on them) the thread it waits for is often descheduled, and the spinner keeps that very
thread off the CPU: a 128-token prefill of the default model took 2.4-5.0 s with two
threads against 0.67 s with one, the load average at 7 on 2 cores. A short spin
(``GOMP_SPINCOUNT=1000``) keeps back-to-back parallel regions hand-off fast and lets a
waiting thread sleep before it starves its peer: 0.36 s in the same minute
(``OMP_WAIT_POLICY=PASSIVE``, sleeping at once: 0.70 s).

No import of torch here: the front end applies this to the engine's environment
(``ipc.spawn``), the offline ``LLM`` to its own before importing torch.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

GOMP_SPINCOUNT = "1000"


def omp_wait_defaults(env: MutableMapping[str, str]) -> None:
    """Set the short barrier spin in ``env``, unless the user chose how OpenMP threads
    wait (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``)."""
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT


def apply_to_this_process() -> None:
    """``omp_wait_defaults`` for this process, if torch is not loaded yet (libgomp reads
    its environment once, when it loads)."""
    import sys

    if "torch" not in sys.modules:
        omp_wait_defaults(os.environ)
