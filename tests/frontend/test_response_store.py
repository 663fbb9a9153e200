"""The response store (SQLite through the standard library) driven directly: rows by id,
the size bound with the oldest evicted first, time to live, two connections (as two
front-end processes) on one file, and reopening (a restart). Plus the async shell, on
both anyio backends."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import pytest

from structllm.server.response_store import SCHEMA, AsyncResponseStore, ResponseStore


def response(i: int, pad: int = 0) -> dict[str, Any]:
    return {"id": f"resp_{i}", "status": "completed", "output": [], "pad": "x" * pad}


def conversation(i: int) -> list[dict[str, Any]]:
    return [{"type": "message", "id": f"msg_{i}", "role": "user", "content": []}]


def test_put_get_delete(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3", max_bytes=1 << 20, ttl=3600)
    store.put(response(1), conversation(1), "req-1")
    got = store.get("resp_1")
    assert got is not None and got.response == response(1) and got.conversation == conversation(1)
    assert got.engine_request_id == "req-1" and not got.cancel_requested
    store.put({**response(1), "status": "cancelled"}, conversation(1))  # replaced, same row
    assert store.count() == 1 and store.get("resp_1").response["status"] == "cancelled"  # type: ignore[union-attr]
    assert store.get("resp_2") is None
    assert store.delete("resp_1") and not store.delete("resp_1")
    assert store.get("resp_1") is None and store.total_size() == 0
    store.close()


def test_size_bound_evicts_oldest_first(tmp_path: Path) -> None:
    one = ResponseStore(tmp_path / "r.sqlite3", max_bytes=1 << 30, ttl=3600)
    one.put(response(0, pad=1000), conversation(0))
    size = one.total_size() + 2  # one row's size (rows 10-19 have 2 more id digits)
    one.close()
    store = ResponseStore(tmp_path / "r.sqlite3", max_bytes=5 * size, ttl=3600)
    for i in range(1, 20):
        store.put(response(i, pad=1000), conversation(i))
        assert store.total_size() <= 5 * size
    assert [store.get(f"resp_{i}") is not None for i in range(20)] == [False] * 15 + [True] * 5
    # the kept total is the rows' real size
    db = sqlite3.connect(tmp_path / "r.sqlite3")
    assert db.execute("SELECT SUM(size) FROM responses").fetchone()[0] == store.total_size()
    db.close()
    store.close()


def test_expired_rows_are_gone(tmp_path: Path) -> None:
    expired = ResponseStore(tmp_path / "r.sqlite3", max_bytes=1 << 20, ttl=-1)  # born expired
    expired.put(response(1), conversation(1))
    assert expired.get("resp_1") is None and not expired.delete("resp_1")
    live = ResponseStore(tmp_path / "r.sqlite3", max_bytes=1 << 20, ttl=3600)
    live.put(response(2), conversation(2))  # a write deletes what has expired
    assert live.count() == 1 and live.get("resp_2") is not None
    expired.close()
    live.close()


def _write_from_another_process(path: str) -> None:
    store = ResponseStore(path, max_bytes=1 << 20, ttl=3600)
    store.put(response(7), conversation(7))
    store.close()


def test_shared_by_processes_and_kept_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.sqlite3"  # the directory is made
    a = ResponseStore(path, max_bytes=1 << 20, ttl=3600)
    a.put(response(1), conversation(1))
    child = multiprocessing.get_context("spawn").Process(
        target=_write_from_another_process, args=(str(path),)
    )
    child.start()
    child.join()
    assert child.exitcode == 0
    assert a.get("resp_7") is not None  # written by the other process
    marked = a.request_cancel("resp_1")
    assert marked is not None and marked.cancel_requested
    a.close()
    b = ResponseStore(path, max_bytes=1 << 20, ttl=3600)  # a restart
    assert b.get("resp_1") is not None and b.get("resp_7") is not None
    assert b.count() == 2
    b.close()


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_async_store_runs_in_a_worker_thread(tmp_path: Path, backend: str) -> None:
    import threading

    loop_thread = threading.get_ident()
    seen: list[int] = []

    async def main() -> None:
        store = AsyncResponseStore(tmp_path / "r.sqlite3", 1 << 20, 3600)
        try:
            await store.put(response(1), conversation(1))
            got = await store.get("resp_1")
            assert got is not None and got.response["id"] == "resp_1"
            seen.append(await store.call(lambda _s: threading.get_ident()))
            assert await store.delete("resp_1") and await store.get("resp_1") is None
        finally:
            store.close()

    anyio.run(main, backend=backend)
    assert seen and seen[0] != loop_thread


def test_a_file_without_owner_pids_is_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    db = sqlite3.connect(path)
    old = "\n".join(line for line in SCHEMA.split("\n") if "owner_pid" not in line)
    db.executescript(old)
    db.close()
    store = ResponseStore(path, max_bytes=1 << 20, ttl=3600)
    store.put(response(1), conversation(1), "req-1", 1234)
    got = store.get("resp_1")
    assert got is not None and got.owner_pid == 1234
    store.close()


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
@pytest.mark.parametrize("cancelled", [0, 4, 8])
def test_puts_commit_in_groups_and_survive_cancelled_waiters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, cancelled: int
) -> None:
    """While one group commits (held at a gate), 8 more puts wait; they commit as one
    group, led by a waiter still there, or by the first leader if every waiter was
    cancelled: no row is lost and nothing hangs."""
    import threading

    from anyio import wait_all_tasks_blocked
    from anyio.lowlevel import checkpoint

    gate = threading.Event()
    groups: list[int] = []
    real = ResponseStore.put_many

    def gated(self: ResponseStore, rows: Any) -> None:
        gate.wait()
        groups.append(len(rows))
        real(self, rows)

    monkeypatch.setattr(ResponseStore, "put_many", gated)
    seen: list[float] = []
    store = AsyncResponseStore(tmp_path / "r.sqlite3", 1 << 20, 3600, lambda _k, s: seen.append(s))

    async def main() -> None:
        try:
            with anyio.fail_after(60):  # a hang guard, not a speed bound
                async with anyio.create_task_group() as tg:
                    tg.start_soon(store.put, response(0), conversation(0))
                    await wait_all_tasks_blocked()  # the first leads, at the gate
                    async with anyio.create_task_group() as doomed:
                        for i in range(1, 9):
                            group = doomed if i <= cancelled else tg
                            group.start_soon(store.put, response(i), conversation(i))
                        await wait_all_tasks_blocked()
                        doomed.cancel_scope.cancel()
                    await checkpoint()
                    gate.set()
                await store.put(response(9), conversation(9))  # and the store goes on
                for i in range(10):
                    assert await store.get(f"resp_{i}") is not None
        finally:
            store.close()

    anyio.run(main, backend=backend)
    assert groups == [1, 8, 1]
    assert len(seen) >= 10 - cancelled  # every put that returned was timed (and each commit)
