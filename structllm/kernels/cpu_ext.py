"""Building and loading the C++ CPU kernels (``cpu_attention.cpp``, ``quant_linear.cpp``).

Compiled on first use with ``torch.utils.cpp_extension`` (needs a C++ compiler and
ninja) for this machine's CPU (``-march=native``; ``STRUCTLLM_CPU_ISA=avx2`` builds
both for ``-march=haswell`` instead, to run the AVX2 code paths on an AVX-512 machine), into the structllm cache, keyed by
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

from structllm.paths import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
FLAGS = ["-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
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
def load(isa: str | None = None) -> Any | None:
    """The compiled attention module (``paged_decode``; ``isa()``: the float16 widening
    compiled in) for ``isa`` (default ``best_isa()``; a CPU without AVX2 gets a plain
    ``-march=native`` build), or None if it cannot be built."""
    isa = isa or best_isa()
    march = _ISA_MARCH[isa] if isa else "-march=native"
    return build(f"structllm_cpu_attention_{isa or 'native'}", SOURCE, [*FLAGS, march],
                 "the CPU attention kernel (once, ~20 s)")


QUANT_SOURCE = Path(__file__).with_name("quant_linear.cpp")
# -ffp-contract=off: the float path's dequantisation (mul, then add the Q4_1 minimum) must
# round like the float32 reference, so the compiler may not fuse it into one FMA.
QUANT_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
ISAS = ("avx2", "avx512")


def best_isa() -> str | None:
    """The widest ISA that ``load_quant`` can build for on this CPU (None: no AVX2).
    ``STRUCTLLM_CPU_ISA=avx2`` forces the AVX2 build on an AVX-512 machine."""
    flags = set(_cpu_flags().split())
    have = [i for i, need in zip(ISAS, _ISA_NEEDS, strict=True) if need <= flags]
    forced = os.environ.get("STRUCTLLM_CPU_ISA")
    if forced:
        if forced not in ISAS:
            raise ValueError(f"STRUCTLLM_CPU_ISA must be one of {ISAS}, got {forced!r}")
        return forced if forced in have else None
    return have[-1] if have else None


_ISA_NEEDS = ({"avx2", "fma", "f16c"}, {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"})
_ISA_MARCH = {"avx2": "-march=haswell", "avx512": "-march=native"}


@cache
def load_quant(isa: str | None = None) -> Any | None:
    """The GGUF block-matmul module built for ``isa`` (default ``best_isa()``), with
    ``linear``, ``dequantize`` and ``isa``; None if the CPU lacks it or the build fails."""
    isa = isa or best_isa()
    if isa is None:
        log.warning("GGUF block kernels need AVX2/FMA/F16C; this CPU lacks them")
        return None
    flags = [*QUANT_FLAGS, _ISA_MARCH[isa]]
    return build(f"structllm_quant_{isa}", QUANT_SOURCE, flags, f"the {isa} GGUF matmul kernels (once, ~30 s)")


def build(stem: str, source: Path, flags: list[str], what: str) -> Any | None:
    """Compile ``source`` (or load the cached build) as a torch extension; None on failure.

    Cached under ``<cache>/extensions``, keyed by the source, torch's version, the CPU's
    flags and the compiler flags, so that a later start only loads the ``.so``."""
    import torch
    import torch.utils.cpp_extension as ext

    # ninja may come from the virtual environment (the `ninja` package), whose bin/ is
    # not on PATH unless the environment is activated
    bindir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")

    key = hashlib.sha256(
        source.read_bytes() + torch.__version__.encode() + _cpu_flags().encode() + " ".join(flags + LDFLAGS).encode()
    )
    name = f"{stem}_{key.hexdigest()[:12]}"
    build_dir = cache_root() / "extensions" / name
    fresh = not any(build_dir.glob(f"{name}*.so"))
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with _build_lock(build_dir):
            if fresh:
                sys.stderr.write(f"structllm: building {what}\n")
            # copies: torch appends its libraries to extra_ldflags in place, which changed the
            # key (so rebuilt) of every later build in the same process
            return ext.load(name, [str(source)], extra_cflags=list(flags), extra_ldflags=list(LDFLAGS),
                            build_directory=str(build_dir), verbose=False)
    except Exception as e:  # no compiler, no ninja, ...: fall back, loudly once
        log.warning("%s unavailable: %s", what.split(" (")[0], e)
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
