"""Client disconnects cancel the request's task tree and abort it in the engine, on
both server backends: streaming or not, queued, in prefill, in decode, and racing the
request's last step. Afterwards nothing is left running, waiting, cached in the KV pool
or open in the front end."""

from __future__ import annotations

import time
from collections.abc import Iterator

import anyio
import httpx
import pytest

from tests.support.procs import wait_for
from tests.support.server import Server, completion, open_stream, read_until, sse_text

pytestmark = pytest.mark.slow

PROMPTS = [f"Write a short sentence about the number {i}." for i in range(10)]


@pytest.fixture(
    scope="module",
    params=[("trio", "1"), ("asyncio", "1"), ("trio", "2")],
    ids=["trio", "asyncio", "trio-two-front-ends"],
)
def config(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def server(config: tuple[str, str]) -> Iterator[Server]:
    backend, front_ends = config
    with Server("--max-model-len", "2048", "--api-server-count", front_ends, backend=backend) as s:
        engine_pid = s.engine_pid
        yield s
        # the same engine served the whole module (it did not die and get replaced)
        assert s.engine_pid == engine_pid and engine_pid > 0
        assert s.stop() == 0


@pytest.fixture(scope="module")
def small(config: tuple[str, str]) -> Iterator[Server]:
    """Two sequences at a time and a tiny token budget: easy to queue, slow to prefill."""
    backend, front_ends = config
    with Server(
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "2",
        "--max-num-batched-tokens",
        "32",
        "--api-server-count",
        front_ends,
        backend=backend,
    ) as s:
        yield s
        assert s.stop() == 0


def test_hundred_streams_with_ten_disconnected_early(server: Server) -> None:
    reference = {
        p: server.post("/v1/completions", completion(p, 12))[1]["choices"][0]["text"]
        for p in PROMPTS
    }
    results: dict[int, str] = {}

    async def one(i: int, client: httpx.AsyncClient) -> None:
        prompt = PROMPTS[i % 10]
        huge = i % 10 == 9
        async with client.stream(
            "POST",
            server.url + "/v1/completions",
            json=completion(prompt, 2000 if huge else 12, stream=True),
        ) as r:
            assert r.status_code == 200
            raw, seen = b"", 0
            async for chunk in r.aiter_bytes():
                raw += chunk
                seen = raw.count(b"data: {")
                if huge and seen >= 3:
                    return  # leaving the block closes the connection mid-stream
            results[i] = sse_text(raw)

    async def main() -> None:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with (
            httpx.AsyncClient(timeout=300, limits=limits) as client,
            anyio.create_task_group() as tg,
        ):
            for i in range(100):
                tg.start_soon(one, i, client)

    anyio.run(main)
    server.wait_idle()
    assert server.metric("num_open_requests") == 0
    assert len(results) == 90
    for i, text in results.items():
        assert text == reference[PROMPTS[i % 10]], f"request {i}"


def test_disconnect_of_a_queued_request(small: Server) -> None:
    long = [
        open_stream(
            small.port, "/v1/completions", completion("Tell me a long story.", 1500, stream=True)
        )
        for _ in range(2)
    ]
    for s in long:
        read_until(s, b"data: {")
    queued = open_stream(
        small.port, "/v1/completions", completion("And another one.", 1500, stream=True)
    )
    wait_for(lambda: small.metric("num_requests_waiting") == 1)
    steps = small.metric("engine_steps_total")
    queued.close()
    wait_for(
        lambda: small.metric("num_requests_waiting") == 0, "the queued request was not aborted"
    )
    # the abort lands within a few engine steps of the disconnect, however slow each is
    assert small.metric("engine_steps_total") - steps < 100
    assert small.metric("num_requests_running") == 2
    for s in long:
        s.close()
    small.wait_idle()
    assert small.metric("num_open_requests") == 0


def test_disconnect_during_a_long_prefill(small: Server) -> None:
    prompt = "alpha beta gamma delta " * 400  # ~1600 tokens at 32 a step: 50 steps of prefill
    s = open_stream(small.port, "/v1/completions", completion(prompt, 300, stream=True))
    wait_for(lambda: small.metric("num_requests_running") == 1)
    assert small.metric("kv_cache_usage_perc") > 0
    got = read_until(s, b"\r\n\r\n")  # the headers: sent once the request is in the engine
    assert b"data:" not in got  # no token yet: still prefilling
    steps = small.metric("engine_steps_total")
    s.close()
    small.wait_idle()
    # Unaborted, the request would take 300 more steps at least (its decode alone); the
    # abort lands within a few steps of the disconnect, however slow each step is.
    assert small.metric("engine_steps_total") - steps < 100


def test_disconnect_of_a_non_streaming_request(server: Server) -> None:
    s = open_stream(server.port, "/v1/completions", completion("Count to a thousand:", 1900))
    wait_for(lambda: server.metric("num_requests_running") == 1)
    steps = server.metric("engine_steps_total")
    s.close()
    server.wait_idle()
    # unaborted it would run 1900 steps; the abort lands within a few of the disconnect
    assert server.metric("engine_steps_total") - steps < 100
    assert server.metric("num_open_requests") == 0


def test_disconnect_racing_the_last_step(server: Server) -> None:
    for i in range(30):
        s = open_stream(server.port, "/v1/completions", completion(PROMPTS[i % 10], 3, stream=True))
        read_until(s, b"data: {", timeout=30)
        if i % 3:
            time.sleep(0.005 * (i % 7))
        s.close()
    server.wait_idle()
    assert server.metric("num_open_requests") == 0
    code, data = server.post("/v1/completions", completion(PROMPTS[0], 4))
    assert code == 200 and data["choices"][0]["finish_reason"] == "length"
