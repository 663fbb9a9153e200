"""llama.cpp's own tools for the tests and benchmarks: the converter
(``convert_hf_to_gguf.py`` with its ``gguf-py``) and ``llama-quantize`` /
``llama-server`` built from the sources that the ``llama-cpp-python`` sdist carries.

Everything lives under ``<structllm cache>/llamacpp`` and is made once: the sdist is
fetched from the package registry with pip, the tools are built with cmake, one target
each. ``python -m tests.support.llamacpp [llama-quantize|llama-server ...]`` builds them
ahead of a test run (``make test`` does so for ``llama-quantize``); a test that needs a
tool and finds it impossible to fetch or build skips with the reason (``ToolMissing``),
but a tool that runs and fails (the converter, ``llama-quantize``) raises
``ToolFailed``, which no test turns into a skip: a file llama.cpp cannot make from a
test model is a failure to look at.

GGUF files made from tiny test models are cached by the content of what made them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from structllm.paths import cache_root
from tests.support.tokenizers import seed_tokenizer

SDIST = "llama-cpp-python==0.3.36"
SDIST_DIR = "llama_cpp_python-0.3.36"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]

# Builds that leave out -march=native: this machine's native build of the whole ggml CPU
# backend dies with SIGILL (llama-quantize's does not reach the code that does), so
# llama-perplexity and the benchmarks' llama-server are built for a named ISA. The
# AVX-512 one is /root/llama-build-avx512's set of flags (VNNI and BF16 included).
PORTABLE = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON"]
PORTABLE += ["-DGGML_F16C=ON", "-DGGML_BMI2=ON"]
ISA_FLAGS = {
    "avx512": [*PORTABLE, "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"],
    "avx2": PORTABLE,
}


class ToolMissing(RuntimeError):
    """A llama.cpp tool cannot be had here; the message says why."""


class ToolFailed(RuntimeError):
    """A llama.cpp tool ran and failed (a test failure, never a skip); its stderr's end."""


def root() -> Path:
    return cache_root() / "llamacpp"


def source_tree() -> Path:
    """llama.cpp's source tree from the sdist, unpacked once."""
    tree = root() / SDIST_DIR / "vendor" / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").exists():
        return tree
    sdist = root() / "sdist"
    sdist.mkdir(parents=True, exist_ok=True)
    tarballs = list(sdist.glob("llama_cpp_python-*.tar.gz"))
    if not tarballs:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        cmd += ["--no-binary", ":all:", SDIST, "-d", str(sdist)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        tarballs = list(sdist.glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not tarballs:
            raise ToolMissing(f"cannot fetch the {SDIST} sdist: {done.stderr.strip()[-400:]}")
    with tarfile.open(tarballs[0]) as tar:
        tar.extractall(root(), filter="data")
    if not (tree / "convert_hf_to_gguf.py").exists():
        raise ToolMissing(f"{tarballs[0].name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
    return tree


def host_isa() -> str:
    """The ISA build this CPU runs: avx512 (with VNNI and BF16) or avx2."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    return "avx512" if {"avx512f", "avx512_vnni", "avx512_bf16"} <= flags else "avx2"


def tool(name: str, isa: str | None = None) -> Path:
    """The path of a built llama.cpp binary (``llama-quantize``, ``llama-server``,
    ``llama-perplexity``), building it on first use (minutes: run ``python -m
    tests.support.llamacpp`` ahead). ``isa`` (``ISA_FLAGS``' names): a build for that ISA
    rather than the native one, in its own build folder."""
    build = root() / ("build" if isa is None else f"build-{isa}")
    binary = build / "bin" / name
    if binary.exists():
        return binary
    if shutil.which("cmake") is None:
        raise ToolMissing("cmake is not installed, so llama.cpp's tools cannot be built")
    tree = source_tree()
    flags = CMAKE_FLAGS + ([] if isa is None else ISA_FLAGS[isa])
    steps = [
        ["cmake", "-S", str(tree), "-B", str(build), *flags],
        ["cmake", "--build", str(build), "--target", name, "-j", str(os.cpu_count() or 2)],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ToolMissing(f"building {name} failed: {done.stderr.strip()[-600:]}")
    if not binary.exists():
        raise ToolMissing(f"building {name} left no {binary}")
    return binary


def _fingerprint(paths: list[Path], *extra: str) -> str:
    h = hashlib.sha256("\0".join(extra).encode())
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def convert_hf(hf_dir: Path, outtype: str = "f32", *args: str, tokenizer: bool = True) -> Path:
    """``hf_dir`` (a Hugging Face directory) as a GGUF file of ``outtype`` (f32, f16,
    bf16, q8_0) written by llama.cpp's converter, with its extra ``args``; cached by
    the directory's content and the arguments. ``tokenizer=False``: a file without a
    vocabulary (``--mmproj``'s), whose tokenizer is not seeded."""
    files = [p for p in hf_dir.iterdir() if p.is_file()]
    out = root() / "gguf" / f"{hf_dir.name}-{_fingerprint(files, outtype, *args)}.{outtype}.gguf"
    if out.exists():
        if tokenizer:
            seed_tokenizer(out)
        return out
    tree = source_tree()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    env = dict(os.environ, PYTHONPATH=str(tree / "gguf-py"), NO_LOCAL_GGUF="")
    cmd = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir)]
    cmd += ["--outfile", str(tmp), "--outtype", outtype, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise ToolFailed(f"convert_hf_to_gguf.py failed: {done.stderr.strip()[-800:]}")
    tmp.rename(out)
    if tokenizer:
        seed_tokenizer(out)
    return out


def convert_lora(adapter_dir: Path, base_dir: Path, outtype: str = "f32") -> Path:
    """PEFT adapter ``adapter_dir`` of the checkpoint ``base_dir`` as a GGUF LoRA file of
    ``outtype`` written by llama.cpp's ``convert_lora_to_gguf.py``; cached by the
    adapter's content."""
    files = [p for p in adapter_dir.iterdir() if p.is_file()]
    out = root() / "gguf" / f"{adapter_dir.name}-{_fingerprint(files, outtype)}.lora.gguf"
    if out.exists():
        return out
    tree = source_tree()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    env = dict(os.environ, PYTHONPATH=str(tree / "gguf-py"), NO_LOCAL_GGUF="")
    cmd = [sys.executable, str(tree / "convert_lora_to_gguf.py"), str(adapter_dir)]
    cmd += ["--base", str(base_dir), "--outfile", str(tmp), "--outtype", outtype]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise ToolFailed(f"convert_lora_to_gguf.py failed: {done.stderr.strip()[-800:]}")
    tmp.rename(out)
    return out


def convert_hf_split(hf_dir: Path, max_tensors: int) -> Path:
    """``hf_dir`` as an F32 model split by the converter (``--split-max-tensors``) into
    parts ``<name>-0000K-of-0000N.gguf`` of at most ``max_tensors`` tensors each; the
    first part's path. Cached by the directory's content."""
    files = [p for p in hf_dir.iterdir() if p.is_file()]
    out = root() / "gguf" / f"{hf_dir.name}-{_fingerprint(files, 'split', str(max_tensors))}"
    if not (out / "complete").exists():
        tree = source_tree()
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        env = dict(os.environ, PYTHONPATH=str(tree / "gguf-py"), NO_LOCAL_GGUF="")
        cmd = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir)]
        cmd += ["--outfile", str(out / "model.gguf"), "--outtype", "f32"]
        cmd += ["--split-max-tensors", str(max_tensors)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise ToolFailed(f"convert_hf_to_gguf.py failed: {done.stderr.strip()[-800:]}")
        (out / "complete").write_text("")
    first = sorted(out.glob("model-00001-of-*.gguf"))[0]
    seed_tokenizer(first)
    return first


def quantize(gguf_file: Path, qtype: str, *extra: str, tokenizer: bool = True) -> Path:
    """``gguf_file`` requantised by ``llama-quantize`` to ``qtype`` (``Q4_K_M``,
    ``Q8_0``, ...); cached next to it. ``extra`` are llama-quantize options
    (e.g. ``--allow-requantize``, ``--pure``); ``tokenizer=False`` for an mmproj file
    (which llama-quantize quantizes too)."""
    out = gguf_file.with_name(f"{gguf_file.stem}.{qtype}{''.join(extra)}.gguf")
    if out.exists():
        if tokenizer:
            seed_tokenizer(out)
        return out
    tmp = out.with_suffix(f".{os.getpid()}.tmp")  # another process may make it too
    cmd = [str(tool("llama-quantize")), *extra, str(gguf_file), str(tmp), qtype]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ToolFailed(f"llama-quantize {qtype} failed: {done.stderr.strip()[-600:]}")
    tmp.rename(out)
    if tokenizer:
        seed_tokenizer(out)
    return out


def default_requantised(qtype: str) -> Path:
    """The default model's file requantised by ``llama-quantize --allow-requantize`` to
    ``qtype`` (from its Q4_1 file, the only one its package holds); cached."""
    from structllm.model.files import default_model_path

    d = root() / "gguf"
    d.mkdir(parents=True, exist_ok=True)
    link = d / default_model_path().name
    if not link.exists():
        link.symlink_to(default_model_path())
    return quantize(link, qtype, "--allow-requantize")


def main(argv: list[str]) -> int:
    """Build the named tools (default: llama-quantize); never fails the caller's run:
    a tool that cannot be built is reported, and its tests skip with the reason."""
    for name in argv or ["llama-quantize"]:
        try:
            print(f"llama.cpp: {name} at {tool(name)}")
        except ToolMissing as e:
            print(f"llama.cpp: {name} unavailable ({e}); tests that need it will skip")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
