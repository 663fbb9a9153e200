"""Building and loading the C++ CPU kernels (``cpu_attention.cpp``, ``quant_linear.cpp``,
``cpu_layer.cpp``, ``cpu_moe.cpp``, ``cpu_decode.cpp``, ``cpu_recurrent.cpp``,
``cpu_lora.cpp``, ``cpu_mla.cpp``).

Compiled with ``torch.utils.cpp_extension`` (needs a C++ compiler and ninja) for this
machine's CPU (``-march=native``; ``STRUCTLLM_CPU_ISA=avx2`` builds for ``-march=haswell``
instead, to run the AVX2 code paths on an AVX-512 machine) into the structllm cache,
keyed by the source, torch's version, the Python ABI and the CPU's flags, so later
starts (from any virtual environment with that torch) just load it. ``make install``
builds them (``structllm build-kernels``); otherwise the first start does, and says so. If the
build fails the engine falls back to the torch reference and says so once.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from structllm.paths import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
HEADERS = [
    Path(__file__).with_name(h)
    for h in ("cpu_simd.h", "cpu_pool.h", "cpu_tables.h", "cpu_iquants.h")
]  # part of each key (cpu_iquants.h: quant_linear.cpp's i-quant kernels)
FLAGS = [
    "-O3",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fopenmp",
]
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
def attention_build(isa: str | None = None) -> tuple[str, list[str]]:
    """The attention kernel's module stem and compiler flags for ``isa`` (default
    ``best_isa()``; a CPU without AVX2 gets a plain ``-march=native`` build)."""
    isa = isa or best_isa()
    march = _ISA_MARCH[isa] if isa else "-march=native"
    return f"structllm_cpu_attention_{isa or 'native'}", [*FLAGS, march]


def load(isa: str | None = None) -> Any | None:
    """The compiled attention module (``paged_decode``; ``isa()``: the float16 widening
    compiled in) for ``isa`` (see ``attention_build``), or None if it cannot be built."""
    stem, flags = attention_build(isa)
    return _share_pool(build(stem, SOURCE, flags, "the CPU attention kernel (about 20 s)"))


LAYER_SOURCE = Path(__file__).with_name("cpu_layer.cpp")


@cache
def load_layer(isa: str | None = None) -> Any | None:
    """The fused layer ops (``rms_norm``, ``silu_mul``, ``rope_store``) built for ``isa``
    (default ``best_isa()``), or None if the CPU lacks AVX2 or the build fails."""
    isa = isa or best_isa()
    if isa is None:
        return None
    return _share_pool(
        build(
            f"structllm_cpu_layer_{isa}",
            LAYER_SOURCE,
            [*FLAGS, _ISA_MARCH[isa]],
            "the fused CPU layer ops (about 20 s)",
        )
    )


QUANT_SOURCE = Path(__file__).with_name("quant_linear.cpp")
# -ffp-contract=off: the float path's dequantisation (mul, then add the Q4_1 minimum) must
# round like the float32 reference, so the compiler may not fuse it into one FMA.
QUANT_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
# the headers only quant_linear.cpp includes, its translation unit cut by what they hold
# (part of its key alone: a change to any rebuilds the module)
QUANT_HEADERS = tuple(
    Path(__file__).with_name(h)
    for h in ("cpu_blocks.h", "cpu_rows.h", "cpu_gemm.h", "cpu_half.h", "cpu_kquants.h")
)
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
    return _share_pool(
        build(
            f"structllm_quant_{isa}",
            QUANT_SOURCE,
            flags,
            f"the {isa} GGUF matmul kernels (about a minute)",
            QUANT_HEADERS,
        )
    )


MOE_SOURCE = Path(__file__).with_name("cpu_moe.cpp")


@cache
def load_moe(isa: str | None = None) -> Any | None:
    """The native experts of a mixture-of-experts layer (``Experts``, see cpu_moe.cpp) for
    ``isa`` (default ``best_isa()``), with ``kernel_table``: the block kernels of the same
    ISA's quant module, which it runs. None if either is missing."""
    isa = isa or best_isa()
    if isa is None:
        return None
    quant = load_quant(isa)
    if quant is None:
        return None
    module = _share_pool(
        build(
            f"structllm_moe_{isa}",
            MOE_SOURCE,
            [*FLAGS, _ISA_MARCH[isa]],  # cpu_layer's flags: its SiLU rounds the same here
            "the CPU mixture-of-experts kernel (about 20 s)",
        )
    )
    if module is None:
        return None
    module.kernel_table = quant.kernel_table()
    return module


MLA_SOURCE = Path(__file__).with_name("cpu_mla.cpp")
# latent attention's function table: cpu_mla.cpp's and the native decode loop's
MLA_HEADERS = (Path(__file__).with_name("cpu_mla.h"),)


@cache
def load_mla(isa: str | None = None) -> Any | None:
    """Latent attention's decode kernel (DeepSeek-V2/V3's, see cpu_mla.cpp) built for
    ``isa`` (default ``best_isa()``), or None if the CPU lacks AVX2 or the build fails."""
    isa = isa or best_isa()
    if isa is None:
        return None
    return _share_pool(
        build(
            f"structllm_mla_{isa}",
            MLA_SOURCE,
            [*FLAGS, _ISA_MARCH[isa]],
            "the latent-attention decode kernel (about 20 s)",
            MLA_HEADERS,
        )
    )


RECURRENT_SOURCE = Path(__file__).with_name("cpu_recurrent.cpp")
# the recurrent kernels' function table: cpu_recurrent.cpp's and the native decode loop's
HYBRID_HEADERS = (Path(__file__).with_name("cpu_hybrid.h"),)


@cache
def load_recurrent(isa: str | None = None) -> Any | None:
    """Hybrid models' recurrent kernels (decode steps and prefill chunks) built
    for ``isa`` (default ``best_isa()``), or None if the CPU lacks AVX2 or the build
    fails."""
    isa = isa or best_isa()
    if isa is None:
        return None
    return _share_pool(
        build(
            f"structllm_recurrent_{isa}",
            RECURRENT_SOURCE,
            [*FLAGS, _ISA_MARCH[isa]],
            "the recurrent-layer kernels (about 20 s)",
            HYBRID_HEADERS,
        )
    )


LORA_SOURCE = Path(__file__).with_name("cpu_lora.cpp")
# LoRA's row kernels: cpu_lora.cpp's and the native decode loop's (cpu_decode.cpp)
LORA_HEADERS = (Path(__file__).with_name("cpu_lora.h"),)


@cache
def load_lora(isa: str | None = None) -> Any | None:
    """LoRA's segmented shrink and expand (``lora_add``, see cpu_lora.cpp) built for
    ``isa`` (default ``best_isa()``), or None if the CPU lacks AVX2 or the build fails."""
    isa = isa or best_isa()
    if isa is None:
        return None
    return _share_pool(
        build(
            f"structllm_lora_{isa}",
            LORA_SOURCE,
            [*FLAGS, _ISA_MARCH[isa]],
            "the LoRA shrink/expand kernel (about 20 s)",
            LORA_HEADERS,
        )
    )


DECODE_SOURCE = Path(__file__).with_name("cpu_decode.cpp")


@cache
def load_decode(isa: str | None = None) -> Any | None:
    """The native decode-step driver (``DecodePlan``, see cpu_decode.cpp) for ``isa``
    (default ``best_isa()``), with ``tables``: the capsules of the same ISA's quant
    kernels (``linears``, ``hint``) and layer ops (``layer_ops``) that it runs (the
    attention kernel's comes from the model's ``CpuAttention``). None if any is missing."""
    isa = isa or best_isa()
    if isa is None:
        return None
    quant, layer = load_quant(isa), load_layer(isa)
    if quant is None or layer is None:
        return None
    module = _share_pool(
        build(
            f"structllm_decode_{isa}",
            DECODE_SOURCE,
            [*FLAGS, _ISA_MARCH[isa]],
            "the native decode-step driver (about 20 s)",
            (*LORA_HEADERS, *HYBRID_HEADERS, *MLA_HEADERS),
        )
    )
    if module is None:
        return None
    module.tables = {
        "linears": quant.kernel_table(),
        "hint": quant.hint_table(),
        "layer_ops": layer.layer_ops(),
    }
    return module


def build(
    stem: str, source: Path, flags: list[str], what: str, headers: tuple[Path, ...] = ()
) -> Any | None:
    """Compile ``source`` (or load the cached build) as a torch extension; None on failure.

    Cached under ``<cache>/extensions``, keyed by the source, torch's version, the
    Python ABI, the CPU's flags and the compiler flags: once per machine and torch
    version. The key holds no path, and a build that is there is imported directly
    rather than handed to torch's loader again: torch's ninja file names the include
    directories of the environment that runs it, so a second virtual environment with
    the same torch would otherwise rebuild (and then keep rebuilding, each environment
    in turn). A build that has to run says so on stderr, with how long it takes, and
    when it is done: otherwise a first start looks hung for a minute."""
    import torch

    name = build_name(stem, source, flags, torch.__version__, headers)
    build_dir = cache_root() / "extensions" / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with _build_lock(build_dir):
            built = build_dir / f"{name}{_abi()}"
            if built.exists():
                return _import(name, built)
            sys.stderr.write(
                f"structllm: building {what} for this machine; once per machine and torch version, "
                f"kept in {build_dir.parent}\n"
            )
            sys.stderr.flush()
            start = time.monotonic()
            module = _compile(name, source, flags, build_dir)
            sys.stderr.write(
                f"structllm: built {what.split(' (')[0]} in {time.monotonic() - start:.0f} s\n"
            )
            return module
    except Exception as e:  # no compiler, no ninja, ...: fall back, loudly once
        log.warning("%s unavailable: %s", what.split(" (")[0], e)
        return None


_POOL: Any = None  # the first loaded kernel module's thread pool (cpu_pool.h), shared


def _share_pool(module: Any) -> Any:
    """Run ``module``'s loops on the process's one kernel pool: the first module loaded
    lends its own to every later one, so no two sets of workers spin against each other.
    Returns ``module`` (None: nothing was built)."""
    global _POOL
    if module is None:
        return None
    if _POOL is None:
        _POOL = module.pool_handle()
    else:
        module.use_pool(_POOL)
    return module


def build_name(
    stem: str, source: Path, flags: list[str], torch_version: str, headers: tuple[Path, ...] = ()
) -> str:
    """``<stem>_<key>``: the key hashes what the build depends on and nothing else (no
    path: every environment with this torch and Python shares the build); ``headers``:
    those that only this source includes."""
    key = hashlib.sha256(
        source.read_bytes()
        + b"".join(h.read_bytes() for h in (*HEADERS, *headers))  # the kernels include them
        + torch_version.encode()
        + _abi().encode()
        + _cpu_flags().encode()
        + " ".join(flags + LDFLAGS).encode()
    )
    return f"{stem}_{key.hexdigest()[:12]}"


def _abi() -> str:
    """The extension-module suffix of this Python (``.cpython-311-x86_64-linux-gnu.so``):
    a build is only good for the interpreter ABI it was compiled against."""
    return str(sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def _import(name: str, path: Path) -> Any:
    """Import a built extension (torch is already imported, so its libraries resolve)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(name: str, source: Path, flags: list[str], build_dir: Path) -> Any:
    import torch.utils.cpp_extension as ext

    # ninja may come from the virtual environment (the `ninja` package), whose bin/ is
    # not on PATH unless the environment is activated
    bindir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    # copies: torch appends its libraries to extra_ldflags in place, which changed the
    # key (so rebuilt) of every later build in the same process
    module = ext.load(
        name,
        [str(source)],
        extra_cflags=list(flags),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )
    # torch names the library "<name>.so"; keep it under the ABI's suffix, which is what
    # later starts (any environment with this Python and torch) import directly
    plain = build_dir / f"{name}.so"
    if plain.exists():
        os.replace(plain, build_dir / f"{name}{_abi()}")
    return module


def build_all() -> list[tuple[str, bool]]:
    """Build (or find) every kernel this machine's engine would load on CPU: the
    attention kernel and the GGUF block kernels for the best ISA. Returns
    ``(module, ok)`` per kernel. For ``structllm build-kernels`` (``make install``)."""
    isa = best_isa()
    out = [("cpu_attention", load() is not None)]
    if isa is not None:
        out.append((f"quant_{isa}", load_quant(isa) is not None))
        out.append((f"cpu_layer_{isa}", load_layer(isa) is not None))
        out.append((f"cpu_moe_{isa}", load_moe(isa) is not None))
        out.append((f"cpu_decode_{isa}", load_decode(isa) is not None))
        out.append((f"cpu_recurrent_{isa}", load_recurrent(isa) is not None))
        out.append((f"cpu_lora_{isa}", load_lora(isa) is not None))
        out.append((f"cpu_mla_{isa}", load_mla(isa) is not None))
    return out


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
