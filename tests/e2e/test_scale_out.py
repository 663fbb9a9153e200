"""Several front-end processes on one port, one engine (``--api-server-count``)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.support.adapters import peft_adapter
from tests.support.models import EXACT, tiny_family_dir
from tests.support.procs import alive, children, engine_of, open_files, shm_entries, wait_for
from tests.support.server import Server

pytestmark = pytest.mark.slow


def workers_of(pid: int) -> list[int]:
    out = []
    for kid in children(pid):
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as f:
                if b"structllm.server.api_server" in f.read():
                    out.append(kid)
        except FileNotFoundError:  # it ended since children() listed it (a restart)
            pass
    return out


def test_metrics_add_up_across_front_ends() -> None:
    with Server("--null-model", "--api-server-count", "3") as s:
        assert len(workers_of(s.proc.pid)) == 2  # type: ignore[union-attr]
        for i in range(30):
            code, _ = s.post(
                "/v1/completions", {"prompt": f"count me {i}", "max_tokens": 7, "ignore_eos": True}
            )
            assert code == 200
        _, text = s.get("/metrics")
        lines = [
            ln
            for ln in text.decode().splitlines()
            if ln.startswith("structllm:request_success_total")
        ]
        finished = sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)
        assert finished == 30
        assert s.metric("generation_tokens_total") == 30 * 7
        assert s.metric("e2e_request_latency_seconds_count") == 30
        assert s.stop() == 0


def test_killing_a_front_end_process_is_handled_like_an_engine_death() -> None:
    before = shm_entries()
    with Server("--null-model", "--api-server-count", "2") as s:
        main = s.proc.pid  # type: ignore[union-attr]
        worker = workers_of(main)[0]
        engine = engine_of(main)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # everything of that generation is replaced, then serves again
            new_workers, new_engine = workers_of(main), engine_of(main)
            if (
                new_workers
                and new_workers[0] != worker
                and new_engine not in (-1, engine)
                and s.get("/health")[0] == 200
            ):
                break
            assert time.monotonic() < deadline, "not restarted"
            time.sleep(0.1)
        assert not alive(worker) and not alive(engine)
        code, data = s.post("/v1/completions", {"prompt": "again", "max_tokens": 3})
        assert code == 200 and data["choices"][0]["finish_reason"] == "length"
        assert s.stop() == 0
        for pid in (*new_workers, new_engine):
            assert not alive(pid), "orphan left behind"
    assert shm_entries() == before


def test_kill_9_of_the_main_process_takes_everything_down() -> None:
    with Server("--null-model", "--api-server-count", "2") as s:
        main = s.proc.pid  # type: ignore[union-attr]
        kids = [engine_of(main), *workers_of(main)]
        assert len(kids) == 2 and all(k > 0 for k in kids)
        os.kill(main, signal.SIGKILL)
        s.proc.wait()  # type: ignore[union-attr]
        wait_for(lambda: not any(alive(k) for k in kids), "children outlived the main process")


def test_runtime_lora_loads_reach_every_front_end(default_files) -> None:  # type: ignore[no-untyped-def]
    # the front ends share one journal of runtime loads (server.lora.Journal, whose
    # replay tests/frontend/test_lora_routes.py checks): the extra front end holds the
    # main process's file, and loads and unloads answer as with one front end (which
    # process accepts a connection is the kernel's choice, so not asserted here)
    base = tiny_family_dir("llama", default_files)
    args = ["--dtype", EXACT["dtype"], "--quantization", EXACT["quantization"]]
    args += ["--kv-cache-memory", "16MiB", "--max-model-len", "256"]
    args += ["--served-model-name", "base", "--enable-lora", "--api-server-count", "2"]
    env = {"STRUCTLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    with Server(str(base), *args, env=env) as s:
        (extra,) = workers_of(s.proc.pid)  # type: ignore[union-attr]
        fds = open_files(extra)
        assert any(f.startswith("/memfd:structllm-lora-journal") for f in fds), fds
        body = {"lora_name": "sql", "lora_path": str(peft_adapter(base, 1))}
        assert s.request("POST", "/v1/load_lora_adapter", body)[0] == 200
        for _ in range(4):
            _, models = s.get("/v1/models")
            assert [m["id"] for m in json.loads(models)["data"]] == ["base", "sql"]
            code, out = s.post("/v1/completions", {"model": "sql", "prompt": "hi", "max_tokens": 2})
            assert code == 200 and out["model"] == "sql", out
        assert s.request("POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})[0] == 200
        code, out = s.post("/v1/completions", {"model": "sql", "prompt": "hi", "max_tokens": 2})
        assert code == 404, out
