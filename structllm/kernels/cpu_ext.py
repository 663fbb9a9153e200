"""Building and loading the C++ CPU attention kernel (``cpu_attention.cpp``).

Compiled on first use with ``torch.utils.cpp_extension`` (needs a C++ compiler and
ninja) for this machine's CPU (``-march=native``), into the structllm cache, keyed by
the source, torch's version and the CPU's flags, so later starts just load it. If the
build fails the engine falls back to the torch reference and says so once.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
         "-fopenmp"]
# at::parallel_for is an inline "#pragma omp parallel": without -fopenmp it runs on one
# thread. The extension then needs libgomp.so.1, which resolves to the copy torch has
# already loaded (same soname), so it shares torch's thread pool rather than adding one.
LDFLAGS = ["-fopenmp"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@cache
def load() -> Any | None:
    """The compiled module (with ``paged_decode``), or None if it cannot be built."""
    import torch
    import torch.utils.cpp_extension as ext

    # ninja may come from the virtual environment (the `ninja` package), whose bin/ is
    # not on PATH unless the environment is activated
    bindir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")

    from structllm.model.loader import cache_root

    key = hashlib.sha256(
        SOURCE.read_bytes() + torch.__version__.encode() + _cpu_flags().encode() + " ".join(FLAGS + LDFLAGS).encode()
    )
    name = f"structllm_cpu_attention_{key.hexdigest()[:12]}"
    build = cache_root() / "extensions" / name
    fresh = not any(build.glob(f"{name}*.so"))
    try:
        build.mkdir(parents=True, exist_ok=True)
        with _build_lock(build):
            if fresh:
                sys.stderr.write("structllm: building the CPU attention kernel (once, ~20 s)\n")
            return ext.load(name, [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=LDFLAGS,
                            build_directory=str(build), verbose=False)
    except Exception as e:  # no compiler, no ninja, ...: fall back, loudly once
        log.warning("CPU attention kernel unavailable, using the torch reference: %s", e)
        return None


@contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """Serialise builds across processes (tensor-parallel ranks, parallel starts).

    torch guards a build with a ``lock`` file that a waiting process polls until it is
    removed; a build killed midway (Ctrl-C on a first start) leaves it behind and every
    later start would wait forever. An flock dies with its holder, so whoever holds it
    knows no build is running and may delete a stale ``lock`` file.
    """
    fd = os.open(build / ".structllm-lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock
