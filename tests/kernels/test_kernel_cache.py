"""The compiled kernels' cache: keyed by what the build depends on (never a path), and a
build that is there is imported as is, from any virtual environment."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from structllm.kernels import cpu_ext


def test_the_key_holds_no_path(monkeypatch: pytest.MonkeyPatch) -> None:
    args = ("structllm_cpu_attention", cpu_ext.SOURCE, cpu_ext.FLAGS, "2.13.0")
    here = cpu_ext.build_name(*args)
    # another virtual environment: another interpreter path and prefix, same torch
    monkeypatch.setattr(sys, "executable", "/elsewhere/.venv/bin/python")
    monkeypatch.setattr(sys, "prefix", "/elsewhere/.venv")
    assert cpu_ext.build_name(*args) == here
    assert cpu_ext.build_name(*args[:3], "2.14.0") != here  # another torch: another build
    assert cpu_ext.build_name(args[0], args[1], [*args[2], "-O2"], args[3]) != here


def test_a_cached_build_is_imported_without_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    real = cpu_ext.load()  # the machine's own build (compiled once, or already cached)
    if real is None:
        pytest.skip("no C++ toolchain here: the CPU kernel cannot be built")
    stem, flags = cpu_ext.attention_build()
    name = cpu_ext.build_name(stem, cpu_ext.SOURCE, flags, torch.__version__)
    built = cpu_ext.cache_root() / "extensions" / name / f"{name}{cpu_ext._abi()}"
    assert built.exists(), "a build is kept under the interpreter's extension suffix"
    # a cache holding only the built library, as another environment would have left it
    cache = tmp_path / "cache"
    (cache / "extensions" / name).mkdir(parents=True)
    shutil.copy(built, cache / "extensions" / name / built.name)
    monkeypatch.setenv("STRUCTLLM_CACHE_DIR", str(cache))

    def no_compiler(*args: object) -> None:
        raise AssertionError("compiled again although the cache holds the build")

    monkeypatch.setattr(cpu_ext, "_compile", no_compiler)
    module = cpu_ext.build(stem, cpu_ext.SOURCE, flags, "the CPU attention kernel")
    assert module is not None and hasattr(module, "paged_decode")


def test_a_build_says_what_it_builds_and_when_it_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STRUCTLLM_CACHE_DIR", str(tmp_path))
    built = object()
    monkeypatch.setattr(cpu_ext, "_compile", lambda *args: built)
    assert (
        cpu_ext.build(
            "structllm_cpu_attention",
            cpu_ext.SOURCE,
            ["-O1"],
            "the CPU attention kernel (about 20 s)",
        )
        is built
    )
    err = capsys.readouterr().err
    assert (
        "building the CPU attention kernel (about 20 s) for this machine; once per machine" in err
    )
    assert "built the CPU attention kernel in" in err


def test_build_kernels_command() -> None:
    from structllm.cli import build_parser, cmd_build_kernels

    args = build_parser().parse_args(["build-kernels", "--allow-missing"])
    assert args.func is cmd_build_kernels and args.allow_missing
