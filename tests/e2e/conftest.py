"""Fixtures shared by the end-to-end modules."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest

from tests.support.models import tiny_family_dir
from tests.support.router import Router, router_binary
from tests.support.server import Server

FLEET_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")  # as if three hosts
FLEET_KEY = "test-key"


def start_together(stack: ExitStack, servers: list[Server]) -> list[Server]:
    """Start ``servers`` at once (each waits for its own health), each one that started
    closed with ``stack``; the first failure is raised after the others are in."""
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(s.__enter__) for s in servers]
    for s, f in zip(servers, futures, strict=True):
        if f.exception() is None:
            stack.push(s.__exit__)
    for f in futures:
        f.result()
    return servers


@pytest.fixture(scope="session")
def tiny_fleet(default_files) -> Iterator[tuple[list[Server], Router]]:  # type: ignore[no-untyped-def]
    """Three ``structllm run`` replicas of a tiny random-weight model (Qwen3's layout,
    2048 positions, cached under the structllm cache), each on its own loopback address,
    with an API key, behind a real ``vllm-router`` (cache-aware policy). Shared by
    ``test_router.py`` and the OpenAI suite's router deployment (``test_server_openai``),
    so it starts once per session."""
    if router_binary() is None:
        pytest.skip("vllm-router is not installed (a test extra)")
    path = tiny_family_dir("qwen3", default_files, max_position_embeddings=2048)
    with ExitStack() as stack:
        args = (str(path), "--max-model-len", "1024", "--kv-cache-memory", "32MiB")
        servers = start_together(
            stack, [Server(*args, api_key=FLEET_KEY, host=h) for h in FLEET_HOSTS]
        )
        router = stack.enter_context(
            Router([s.url for s in servers], "cache_aware", api_key=FLEET_KEY)
        )
        yield servers, router
        assert [s.stop() for s in servers] == [0, 0, 0]
