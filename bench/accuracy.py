r"""Accuracy of a GGUF file's quantised paths against llama.cpp's, on the same token windows.

For each file, teacher-forced over the windows of ``tests/data/accuracy_text.txt``
(``--windows`` windows of 512 tokens; see ``tests/support/accuracy.py`` for what is
scored: llama-perplexity's positions, the second half of each window): the mean KL
divergence from the float32 model of the same file and the top-1 agreement with it, for

- structllm's default path (``--cpu-activations auto``), its 16-bit path (``int16``) and
  its 8-bit path (``int8``), each against structllm's exact float path (the file's
  weights dequantised in registers, float32 activations, a float32 KV cache);
- llama.cpp: ``llama-perplexity --kl-divergence-base`` on the file dequantised to F32
  by ``llama-quantize --allow-requantize ... F32`` (float32 KV cache too), then
  ``--kl-divergence`` on the file itself (its default settings, as structllm's).

llama-perplexity tokenizes the text and stores the ids of its windows in the base file;
structllm scores those very ids (and says whether its own tokenizer agrees). Also
printed, as a check that both score the same thing: the KL divergence and top-1
agreement of structllm's float32 model against llama.cpp's (its stored base).

The bar (issue 46): structllm's default path passes when its KL divergence is at most
1.1x llama.cpp's and its top-1 agreement at least llama.cpp's minus 0.3 points.

    python bench/accuracy.py [--windows 32] [--threads 2] [FILE.gguf ...]
    python bench/accuracy.py --windows 4 --save tests/data/llamacpp_accuracy.json

Without files: the default model requantised by llama-quantize (``--allow-requantize``
from its Q4_1 file: the only one its package holds) to Q4_K_M, Q5_K_M, Q6_K, Q8_0,
IQ4_XS and Q4_0. ``--save`` writes llama.cpp's figures (with the command, the build and
the windows' digest) for tests/engine/test_accuracy_bar.py. llama-perplexity is built once from
the llama-cpp-python sdist's tree (``tests/support/llamacpp.py``, ``--isa``). Accuracy
figures do not depend on the machine's load; the KL of a few windows is noisy from text
to text, not from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import accuracy, llamacpp

TYPES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "Q4_0"]
PATHS = ["auto", "int16", "int8"]  # --cpu-activations
KL_RATIO, TOP1_POINTS = 1.1, 0.3  # the bar


def passes(ours: dict[str, float], theirs: dict[str, float]) -> bool:
    return ours["kl"] <= KL_RATIO * theirs["kl"] and ours["top1"] >= theirs["top1"] - TOP1_POINTS


# -- llama.cpp's side ----------------------------------------------------------------


def dequantised(path: Path) -> Path:
    """``path`` as F32 (llama-quantize), cached beside the other accuracy files."""
    out = llamacpp.root() / "accuracy" / f"{path.stem}.F32.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [str(llamacpp.tool("llama-quantize")), "--allow-requantize", str(path), str(tmp)]
        run([*cmd, "F32"])
        tmp.rename(out)
    return out


def run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed: {done.stderr[-1500:]}")
    return done.stdout + done.stderr


def perplexity_cmd(a: argparse.Namespace, model: Path, *extra: str) -> list[str]:
    exe = str(llamacpp.tool("llama-perplexity", a.isa))
    return [exe, "-m", str(model), "-c", str(accuracy.N_CTX), "-t", str(a.threads), *extra]


def llamacpp_side(a: argparse.Namespace, path: Path) -> tuple[dict[str, Any], Path]:
    """llama.cpp's KL divergence and top-1 agreement on ``path``; its base file."""
    base = llamacpp.root() / "accuracy" / f"{path.stem}.w{a.windows}.kld"
    f32 = dequantised(path)
    kv32 = ["-ctk", "f32", "-ctv", "f32"]
    chunks = ["--chunks", str(a.windows)]
    base_cmd = perplexity_cmd(a, f32, "-f", str(accuracy.TEXT), *chunks, *kv32,
                              "--kl-divergence-base", str(base))  # fmt: skip
    run(base_cmd)
    cmd = perplexity_cmd(a, path, "--kl-divergence-base", str(base), "--kl-divergence")
    out = run(cmd)
    kl = re.search(r"Mean\s+KLD:\s+([-0-9.]+)", out)
    top = re.search(r"Same top p:\s+([0-9.]+)", out)
    if kl is None or top is None:
        raise RuntimeError(f"no KLD / Same top p in llama-perplexity's output: {out[-1500:]}")
    got = {"kl": float(kl.group(1)), "top1": float(top.group(1))}
    return {**got, "base_cmd": shown(base_cmd), "cmd": shown(cmd)}, base


def shown(cmd: list[str]) -> str:
    """A command as the JSON records it: file names without their folders."""
    return " ".join(Path(c).name if "/" in c else c for c in cmd)


def llamacpp_build(a: argparse.Namespace) -> str:
    out = run([str(llamacpp.tool("llama-perplexity", a.isa)), "--version"])
    version = " ".join(
        line.strip() for line in out.splitlines() if "version" in line or "built" in line
    )
    return (
        f"{llamacpp.SDIST} sdist, {a.isa} build ({' '.join(llamacpp.ISA_FLAGS[a.isa])}): {version}"
    )


# -- structllm's side ----------------------------------------------------------------


def measure(a: argparse.Namespace, name: str, path: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"file": path.name}
    base = None
    if not a.no_llamacpp:
        row["llamacpp"], base_path = llamacpp_side(a, path)
        base = accuracy.BaseFile.read(base_path)
        ws = accuracy.windows(base.tokens, a.windows)
    else:
        ws = accuracy.windows(accuracy.own_tokens(path), a.windows)
    row["windows"] = accuracy.windows_digest(ws)
    row["own_tokenizer_agrees"] = row["windows"] == accuracy.windows_digest(
        accuracy.windows(accuracy.own_tokens(path), a.windows)
    )
    scores = accuracy.structllm_scores(path, ws, a.paths, base)
    row["structllm"] = {p: {"kl": s.kl, "top1": s.top1} for p, s in scores.items()}
    if "llamacpp" in row and "auto" in a.paths:
        row["passes"] = passes(row["structllm"]["auto"], row["llamacpp"])
    return row


def show(name: str, row: dict[str, Any]) -> None:
    def cell(s: dict[str, float]) -> str:
        return f"KL {s['kl']:.3e}  top-1 {s['top1']:6.2f}%"

    agrees = "agrees" if row["own_tokenizer_agrees"] else "DIFFERS"
    print(f"\n{name} ({row['file']}; windows {row['windows']}, structllm's tokenizer {agrees})")
    for p, s in row["structllm"].items():
        print(f"  structllm {p:<20} {cell(s)}")
    if "llamacpp" in row:
        print(f"  llama.cpp {'':<20} {cell(row['llamacpp'])}")
    if "passes" in row:
        ours, theirs = row["structllm"]["auto"], row["llamacpp"]
        print(f"  bar: KL {ours['kl'] / theirs['kl']:.3f}x llama.cpp's (<= {KL_RATIO}), top-1 "
              f"{ours['top1'] - theirs['top1']:+.2f} points (>= -{TOP1_POINTS}): "
              f"{'PASS' if row['passes'] else 'FAIL'}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="llama-perplexity's -t")
    ap.add_argument("--types", default=",".join(TYPES), help="without files: the types")
    ap.add_argument("--paths", default=",".join(PATHS), help="structllm's --cpu-activations")
    ap.add_argument("--isa", default=llamacpp.host_isa(), choices=list(llamacpp.ISA_FLAGS))
    ap.add_argument("--no-llamacpp", action="store_true", help="structllm's side only")
    ap.add_argument("--save", type=Path, help="write llama.cpp's figures (JSON) for the test")
    a = ap.parse_args()
    a.paths = a.paths.split(",")
    files = (
        {p.name: p for p in a.files}
        if a.files
        else {t: llamacpp.default_requantised(t) for t in a.types.split(",")}
    )
    rows = {}
    for name, path in files.items():
        rows[name] = measure(a, name, path)
        show(name, rows[name])
    print(json.dumps(rows))
    if a.save:
        out = {
            "what": "llama-perplexity --kl-divergence of the default model's requantised files",
            "command": "python bench/accuracy.py " + " ".join(sys.argv[1:]),
            "llamacpp_build": llamacpp_build(a),
            "text": str(accuracy.TEXT.relative_to(Path(__file__).resolve().parents[1])),
            "n_ctx": accuracy.N_CTX,
            "windows": a.windows,
            "files": rows,
        }
        a.save.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
