"""Several front-end processes on one port, one engine (``--api-server-count``)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.procs import alive, children, engine_of, shm_entries, wait_for
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
