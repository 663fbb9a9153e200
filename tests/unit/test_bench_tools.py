"""The benches' shared tools: ``bench/llama_server.py``'s launcher (against a stand-in
server script) and ``bench/models.py``'s bytes a decoded token reads."""

from __future__ import annotations

import argparse
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from bench.llama_server import LlamaServer, LlamaServerFailed
from bench.models import arms, summarize, token_read_bytes, weight_bytes_per_token

# A stand-in for llama-server: answers /health on the --port it is given.
FAKE_SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print("fake llama-server listening", file=sys.stderr, flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""

FAILING_SERVER = """
import sys
print("error: failed to load model 'x.gguf'", file=sys.stderr)
sys.exit(3)
"""


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


def test_llama_server_serves_inside_the_with_and_is_stopped_after(tmp_path: Path) -> None:
    binary = script(tmp_path, "llama-server", FAKE_SERVER)
    server = LlamaServer(binary, "m.gguf", ["-np", "4", "--lora", "a.gguf"], threads=2)
    assert server.cmd[1:] == [
        *("-m", "m.gguf", "--host", "127.0.0.1", "--port", str(server.port)),
        *("-t", "2", "-tb", "2", "-np", "4", "--lora", "a.gguf"),
    ]
    with server:
        with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
            assert r.status == 200
        assert server.proc is not None and server.proc.poll() is None
        assert "listening" in server.output_tail()
    assert server.proc.poll() is not None  # terminated on the way out


def test_llama_server_without_threads_passes_no_thread_flags(tmp_path: Path) -> None:
    server = LlamaServer(tmp_path / "llama-server", "m.gguf", ["-c", "64"])
    assert "-t" not in server.cmd and "-tb" not in server.cmd and server.cmd[-2:] == ["-c", "64"]


def test_llama_server_exiting_early_raises_with_its_stderr(tmp_path: Path) -> None:
    binary = script(tmp_path, "llama-server", FAILING_SERVER)
    server = LlamaServer(binary, "x.gguf")
    with pytest.raises(LlamaServerFailed, match="status 3(.|\n)*failed to load model"):
        server.launch()
    assert server.proc is not None and server.proc.poll() == 3


def test_llama_server_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(LlamaServerFailed, match="no llama-server binary"):
        LlamaServer(tmp_path / "nowhere", "m.gguf").launch()


def test_llama_server_timeout_stops_the_process(tmp_path: Path) -> None:
    binary = script(tmp_path, "llama-server", "import time\ntime.sleep(60)\n")
    server = LlamaServer(binary, "m.gguf", timeout=1.0)
    with pytest.raises(LlamaServerFailed, match="not healthy after 1 s"):
        server.launch()
    assert server.proc is not None and server.proc.poll() is not None


# A MoE file's tensors: (name, GGUF shape innermost first, bytes); 8 experts, top 2.
EMBED = ("token_embd.weight", [64, 1000], 64_000)
HEAD = ("output.weight", [64, 1000], 64_000)
DENSE = [("blk.0.attn_q.weight", [64, 64], 4096), ("blk.0.attn_norm.weight", [64], 256)]
ROUTER = [("blk.0.ffn_gate_inp.weight", [64, 8], 2048), ("blk.0.exp_probs_b.bias", [8], 32)]
EXPERTS = [
    ("blk.0.ffn_gate_exps.weight", [64, 32, 8], 8000),
    ("blk.0.ffn_up_exps.weight", [64, 32, 8], 8000),
    ("blk.0.ffn_down_exps.weight", [32, 64, 8], 8000),
    ("blk.0.ffn_up_exps.bias", [32, 8], 1024),
]
SHARED = [("blk.0.ffn_up_shexp.weight", [64, 32], 3000)]


def test_token_read_bytes_counts_the_top_k_of_the_routed_experts() -> None:
    tensors = [EMBED, HEAD, *DENSE, *ROUTER, *EXPERTS, *SHARED]
    rest = 64_000 + 4096 + 256 + 2048 + 32 + 3000  # head, attention, router, shared
    assert token_read_bytes(tensors, 8, 2) == rest + (3 * 8000 + 1024) * 2 // 8
    assert token_read_bytes(tensors, 8, 8) == rest + 3 * 8000 + 1024  # every expert


def test_token_read_bytes_embedding_tables() -> None:
    # tied head: the table is the head's weight, read whole
    assert token_read_bytes([EMBED, *DENSE], 0, 0) == 64_000 + 4096 + 256
    per_layer = ("per_layer_token_embd.weight", [256, 1000], 256_000)  # one row a token
    assert token_read_bytes([EMBED, HEAD, per_layer, *DENSE], 0, 0) == 64_000 + 4096 + 256


def test_token_read_bytes_refuses_more_experts_used_than_there_are() -> None:
    with pytest.raises(ValueError, match="experts used 9 of 8"):
        token_read_bytes(EXPERTS, 8, 9)


def test_weight_bytes_per_token_reads_experts_from_the_file(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_expert_count(4)
    w.add_expert_used_count(1)
    arrays = {
        "output.weight": np.zeros((10, 16), np.float32),  # 640 bytes
        "token_embd.weight": np.zeros((10, 16), np.float32),
        "blk.0.ffn_gate_inp.weight": np.zeros((4, 16), np.float32),  # 256
        "blk.0.ffn_up_exps.weight": np.zeros((4, 8, 16), np.float32),  # [E, F, H]: 2048
    }
    for name, array in arrays.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert weight_bytes_per_token(path) == 640 + 256 + 2048 // 4


def test_arms_of_a_directory_and_of_a_gguf_file() -> None:
    args = argparse.Namespace(
        formats="float32:none,auto:auto,auto:loop", llama_server="ls", llama_threads="0,1"
    )
    assert arms("hf", args) == [("float32:none", None), ("auto:auto", None)]
    assert arms("gguf", args) == [
        *(("float32:none", None), ("auto:auto", None), ("auto:loop", None)),
        *(("llama-server", 0), ("llama-server -t 1", 1)),
    ]
    args.llama_server = None
    assert [t for _, t in arms("gguf", args)] == [None, None, None]


def test_summarize_gives_median_and_spread_per_arm(capsys: pytest.CaptureFixture[str]) -> None:
    def row(fmt: str, single: float, **extra: object) -> dict[str, object]:
        return {"model": "m", "format": fmt, "single_tok_s": single, **extra}

    rows = [
        row("auto:auto", 10.0, bandwidth_share=0.5),
        row("llama-server", 5.0, vs_auto={"single": 2.0}),
        row("auto:auto", 30.0, bandwidth_share=0.7),
        row("llama-server", 8.0, vs_auto={"single": 1.5}),
        row("auto:auto", 12.0, bandwidth_share=0.6),
        row("llama-server", 6.0, vs_auto={"single": 1.9}),
    ]
    ours, theirs = summarize(rows)
    assert ours["rounds"] == 3 and ours["single_tok_s"] == {
        "median": 12.0,
        "min": 10.0,
        "max": 30.0,
    }
    assert ours["bandwidth_share"]["median"] == 0.6 and "vs_auto_single" not in ours
    assert theirs["vs_auto_single"] == {"median": 1.9, "min": 1.5, "max": 2.0}
    out = capsys.readouterr().out
    assert "single_tok_s 12.0 [10.0-30.0]" in out and "ratio single 1.90 [1.50-2.00]x" in out
