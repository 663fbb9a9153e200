"""``structllm run --scheduling-policy priority`` on real processes (null model): the
``priority`` field on chat, completions and Responses, its 400s (not an int64; non-zero
under fcfs, vLLM's message), the per-priority waiting gauge while a one-seat engine
holds an urgent request and queues two less urgent ones behind it, and the queue bound
(503) that a more urgent request passes."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import pytest

from tests.e2e.conftest import start_together
from tests.support.procs import HANG_S
from tests.support.server import Server, completion, open_stream, read_until

NULL = ("--null-model", "--max-model-len", "2048", "--null-step-time", "0.02")
ENDPOINTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ("/v1/completions", completion("hi", 4)),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 16, "store": False}),
]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server]]:
    """A fcfs server (the default) and a one-seat priority server that queues two requests
    of any priority, started together."""
    with ExitStack() as stack:
        fcfs, prio = start_together(
            stack,
            [
                Server(*NULL),
                Server(
                    *NULL,
                    *("--scheduling-policy", "priority", "--max-num-seqs", "1"),
                    *("--max-queued-requests", "2"),
                ),
            ],
        )
        yield fcfs, prio


def test_priority_is_taken_by_every_endpoint(servers: tuple[Server, Server]) -> None:
    fcfs, prio = servers
    for path, body in ENDPOINTS:
        for server, value in ((prio, -3), (prio, 7), (fcfs, 0)):
            status, data = server.post(path, {**body, "priority": value})
            assert status == 200, (path, value, data)


def test_bad_priorities_are_400s_naming_the_field(servers: tuple[Server, Server]) -> None:
    fcfs, prio = servers
    for path, body in ENDPOINTS:
        for value in (1.5, "1", True, 2**63, -(2**63) - 1, 2**70):
            status, data = prio.post(path, {**body, "priority": value})
            assert status == 400, (path, value, data)
            assert data["error"]["param"] == "priority", data
        status, data = fcfs.post(path, {**body, "priority": 2})
        assert status == 400, (path, data)
        assert data["error"] == {
            "message": "Got priority 2 but Priority scheduling is not enabled.",
            "type": "invalid_request_error",
            "param": "priority",
            "code": None,
        }


def waiting_by_priority(server: Server) -> dict[str, float]:
    _, text = server.get("/metrics")
    pattern = r'^structllm:num_requests_waiting_by_priority\{[^}]*priority="(-?\d+)"\} (\S+)$'
    return {p: float(n) for p, n in re.findall(pattern, text.decode(), re.M)}


def test_the_gauge_counts_the_queued_by_priority(servers: tuple[Server, Server]) -> None:
    _, prio = servers
    # the one seat: an urgent stream that runs until it is closed (1900 steps of 20 ms)
    held = open_stream(prio.port, "/v1/completions", completion("x", 1900, True, priority=0))
    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        stack.callback(held.close)
        assert b"data: {" in read_until(held, b"data: {")
        # less urgent than the seat's holder: they queue (priority 0 is not displaced)
        queued = [
            pool.submit(prio.post, "/v1/completions", completion("y", 4, priority=p))
            for p in (2, 1)
        ]
        end = time.monotonic() + HANG_S  # a hang guard only
        while waiting_by_priority(prio) != {"1": 1, "2": 1}:
            assert time.monotonic() < end, waiting_by_priority(prio)
            time.sleep(0.05)
        held.close()  # the holder leaves: both run
        assert [f.result()[0] for f in queued] == [200, 200]
    prio.wait_idle()
    assert waiting_by_priority(prio) == {}


def test_an_urgent_request_enters_a_queue_full_of_less_urgent_ones(
    servers: tuple[Server, Server],
) -> None:
    _, prio = servers
    # the one seat: a priority-5 stream that runs until it is closed (1900 steps of 20 ms)
    held = open_stream(prio.port, "/v1/completions", completion("x", 1900, True, priority=5))
    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        stack.callback(held.close)
        assert b"data: {" in read_until(held, b"data: {")
        queued = [  # equal to the seat's holder: they wait, and fill the bound of 2
            pool.submit(prio.post, "/v1/completions", completion(f"q{i}", 4, priority=5))
            for i in range(2)
        ]
        end = time.monotonic() + HANG_S  # a hang guard only
        while waiting_by_priority(prio) != {"5": 2}:
            assert time.monotonic() < end, waiting_by_priority(prio)
            time.sleep(0.05)
        for path, body in ENDPOINTS[:2]:
            for value in (5, 9):  # equal or less urgent than the queue: refused at once
                status, data = prio.post(path, {**body, "priority": value})
                assert status == 503, (path, value, data)
                assert data["error"]["code"] == "overloaded"
        for path, body in ENDPOINTS:  # more urgent than all of it: enters and runs
            status, data = prio.post(path, {**body, "priority": 0})
            assert status == 200, (path, data)
        held.close()
        assert [f.result()[0] for f in queued] == [200, 200]
    prio.wait_idle()
