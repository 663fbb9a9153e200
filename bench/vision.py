r"""Images through a GGUF model + mmproj pair: structllm against llama.cpp's
``llama-server --mmproj`` on the same files, in the same run.

The pair is written by llama.cpp's converter (``tests/support/mmproj.py``) from a
checkpoint built by code with seeded random weights (cached): ``--size tiny`` is the
tests' tiny Gemma 3 (64x64 images, 16 image tokens), ``--size tiny-smolvlm`` the tests'
tiny SmolVLM (tiles of 32, an 896x896 image 2x2 tiles and the global one, 4 tokens
each); ``--size siglip400m`` (Gemma 3) has the
released Gemma 3's tower (SigLIP-400M shapes: hidden 1152, 27 layers, 16 heads,
intermediate 4304, patch 14, 896x896 images, 256 image tokens) before a small text
model. The model GGUF is ``--model-type`` (default Q8_0, by llama-quantize), the mmproj
``--mmproj-type`` (default F16, the published form).

Both servers get the same threads (``-t``/``-tb`` and ``--engine-threads``). Per server,
after a warm-up with another image: a chat completion with one new 896x896 image (resized
by each server's processor) and a short question, streamed: time to first token and the
decode speed after it (``--max-tokens`` tokens, EOS ignored); the same question without
an image (decode speed unchanged by the image?); the same image again behind other text
(structllm: an encoder cache hit, the prefix cache missing from the first block; llama.cpp
keeps no encoder output across requests); and the resident memory the first image added
(structllm's engine process, llama-server). Medians over ``--reps``; the order of the two
servers rotates per rep.

    python bench/vision.py --size tiny
    python bench/vision.py --size siglip400m     # against the tests' AVX-512 llama-server
    STRUCTLLM_CPU_ISA=avx2 python bench/vision.py --size siglip400m \
        --llama-server ~/.cache/structllm/llamacpp/build-avx2/bin/llama-server
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve.py, beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

import serve
from llama_server import LlamaServer, LlamaServerFailed

from structllm.paths import cache_root

DEFAULT_LLAMA_SERVER = cache_root() / "llamacpp" / "build-avx512" / "bin" / "llama-server"
QUESTION = "Describe this picture in one sentence."
IMAGE_SIDE = 896
# the released Gemma 3's vision tower (SigLIP-400M) before a small text model
SIGLIP400M: dict[str, Any] = dict(
    text_config=dict(
        model_type="gemma3_text",
        vocab_size=49160,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        query_pre_attn_scalar=256,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    vision_config=dict(
        model_type="siglip_vision_model",
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        image_size=896,
        patch_size=14,
        vision_use_head=False,
    ),
    mm_tokens_per_image=256,
    boi_token_index=49152,
    image_token_index=49153,
    eoi_token_index=49154,
)


def pair(size: str, model_type: str, mmproj_type: str) -> tuple[Path, Path]:
    from structllm.model.loader import prepare_model
    from tests.support.mmproj import gguf_pair, published_dir
    from tests.support.vision import gemma3_vision_dir

    files = prepare_model(None)
    if size == "tiny-smolvlm":
        from tests.support.idefics3 import tiny_idefics3_dir

        directory = tiny_idefics3_dir(files)
    elif size == "tiny":
        directory = gemma3_vision_dir(files)
    else:
        directory = gemma3_vision_dir(files, SIGLIP400M, "bench-gemma3-siglip400m")
    return gguf_pair(published_dir(directory), model_type, mmproj_type)


def image_url(seed: int) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(a: argparse.Namespace, model: Path, mmproj: Path) -> dict[str, tuple[Any, str]]:
    threads = str(a.threads)
    port = free_port()
    ours = subprocess.Popen(
        [sys.executable, "-m", "structllm", "run", str(model), "--mmproj", str(mmproj)]
        + ["--port", str(port), "--log-level", "warning", "--engine-threads", threads]
        + ["--speculative-config", '{"method": "none"}']  # plain decoding on both sides
    )
    servers: dict[str, tuple[Any, str]] = {"structllm": (ours, f"http://127.0.0.1:{port}")}
    if a.llama_server:
        flags = ["--mmproj", str(mmproj), "-np", "1", "-c", "4096", "--log-disable", "--no-warmup"]
        llama = LlamaServer(a.llama_server, model, flags, threads=a.threads)
        try:
            llama.start()
        except LlamaServerFailed:
            stop(servers)
            raise
        servers["llama.cpp"] = (llama, llama.url)
    try:  # both load at once
        serve.wait_healthy(ours, servers["structllm"][1])
        if a.llama_server:
            llama.wait_healthy()
    except BaseException:
        stop(servers)
        raise
    return servers


def stop(servers: dict[str, tuple[Any, str]]) -> None:
    """Every server in ``servers`` stopped (structllm: its process; llama.cpp: its
    ``LlamaServer``)."""
    for server, _ in servers.values():
        if isinstance(server, LlamaServer):
            server.stop()
        else:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)


def chat(url: str, text: str, image: str | None, max_tokens: int) -> dict[str, float]:
    """One streamed chat completion: time to first content, decode tokens/s after it."""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": image}})
    body = {
        "model": httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"],
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    chunks, usage = 0, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    last = time.perf_counter()
                    first = first if first is not None else last
                    chunks += 1
    if first is None or last is None:
        raise SystemExit(f"{url}: no content streamed")
    tokens = int(usage["completion_tokens"]) if usage else chunks
    return {
        "ttft_ms": 1000 * (first - t0),
        "decode_tok_s": (tokens - 1) / (last - first) if last > first else float("nan"),
        "prompt_tokens": float(usage["prompt_tokens"]) if usage else float("nan"),
    }


def rss_of(name: str, proc: Any) -> float:
    pid = serve.engine_pid(proc.pid) if name == "structllm" else proc.pid
    return serve.rss_mb(pid) if pid is not None else float("nan")


def measure(servers: dict[str, tuple[Any, str]], a: argparse.Namespace) -> dict[str, Any]:
    got: dict[str, dict[str, list[float]]] = {name: {} for name in servers}
    names = list(servers)
    for name, (proc, url) in servers.items():  # warm-up; the memory one image adds
        chat(url, "Hello", None, 4)
        before = rss_of(name, proc)
        chat(url, QUESTION, image_url(10_000), 4)
        got[name]["first_image_rss_mb"] = [rss_of(name, proc) - before]
    for rep in range(a.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            url = servers[name][1]
            image = image_url(rep)
            fresh = chat(url, QUESTION, image, a.max_tokens)
            again = chat(url, f"Once more, rep {rep}: {QUESTION}", image, a.max_tokens)
            text = chat(url, QUESTION, None, a.max_tokens)
            for key, value in (
                ("ttft_ms", fresh["ttft_ms"]),
                ("decode_tok_s", fresh["decode_tok_s"]),
                ("prompt_tokens", fresh["prompt_tokens"]),
                ("repeat_ttft_ms", again["ttft_ms"]),
                ("text_decode_tok_s", text["decode_tok_s"]),
            ):
                got[name].setdefault(key, []).append(value)
    return {
        name: {k: round(statistics.median(v), 2) for k, v in d.items()} for name, d in got.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", choices=("tiny", "tiny-smolvlm", "siglip400m"), default="tiny")
    ap.add_argument("--model-type", default="Q8_0")
    ap.add_argument("--mmproj-type", default="f16")
    # (the tests' AVX-512 build: python -c "from tests.support.llamacpp import tool;
    # tool('llama-server', 'avx512')"; an empty value runs structllm alone)
    ap.add_argument("--llama-server", default=str(DEFAULT_LLAMA_SERVER))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    model, mmproj = pair(a.size, a.model_type, a.mmproj_type)
    servers = start(a, model, mmproj)
    try:
        result = measure(servers, a)
    finally:
        stop(servers)
    ours, llama = result.get("structllm", {}), result.get("llama.cpp", {})
    keys = list(ours)
    print(f"{'':24}{'structllm':>12}{'llama.cpp':>12}{'ratio':>8}")
    for k in keys:
        b = llama.get(k, float("nan"))
        print(f"{k:24}{ours[k]:>12}{b:>12}{serve.div(ours[k], b):>8}")
    load = os.getloadavg()[0]
    print(
        json.dumps(
            {"size": a.size, "model": model.name, "mmproj": mmproj.name, "load": load, **result}
        )
    )


if __name__ == "__main__":
    main()
