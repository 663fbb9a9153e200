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


def uses_fleet(item: pytest.Item) -> bool:
    """``test_router.py``'s tests on the fleet and the OpenAI suite's router deployment."""
    if item.path.name == "test_router.py":
        return "tiny_fleet" in getattr(item, "fixturenames", ())
    callspec = getattr(item, "callspec", None)
    return (
        item.path.name == "test_server_openai.py"
        and callspec is not None
        and callspec.params.get("deployment") == "router"
    )


_last_user: list[pytest.Item] = []  # the last test that uses the fleet
_closers: list[ExitStack] = []  # the running fleet's


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fleet's users run one after the other (from the first one's place), so the
    fleet is up only while they run (``pytest_runtest_teardown`` stops it after the
    last), not idle through the rest of the session."""
    users = [i for i in items if uses_fleet(i)]
    if not users:
        return
    first = items.index(users[0])
    rest = [i for i in items if not uses_fleet(i)]
    items[:] = [*rest[:first], *users, *rest[first:]]
    _last_user[:] = users[-1:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield
    if _last_user and item is _last_user[0]:
        while _closers:
            _closers.pop().close()


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
        codes: list[int] = []
        stack.callback(
            lambda: codes.extend(s.stop() for s in servers if s.proc and s.proc.poll() is None)
        )
        _closers.append(stack)
        yield servers, router
        stack.close()  # (if the last user's teardown has not)
        assert codes == [0, 0, 0], codes
