"""The response store (SQLite through the standard library) driven directly: rows by id,
the size bound with the oldest evicted first, time to live, two connections (as two
front-end processes) on one file, and reopening (a restart). Plus the front end's async
shell and its store process, on both anyio backends."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import pytest

from structllm.server.response_store import SCHEMA, ResponseStore
from structllm.server.store_client import AsyncResponseStore, StoreError, StoreUnavailable


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_async_store_runs_in_its_own_process_and_survives_its_death(
    tmp_path: Path, backend: str
) -> None:
    """Every call goes to a child process (not this one); killing it fails the call that
    finds it gone with a 503 naming it (no hang), the next call starts a new one on the
    same file (rows kept), and ``close`` reaps it."""
    seen: list[str] = []
    store = AsyncResponseStore(tmp_path / "r.sqlite3", 1 << 20, 3600, lambda k, _s: seen.append(k))
    pids: list[int] = []

    async def main() -> None:
        try:
            with anyio.fail_after(60):  # a hang guard, not a speed bound
                await store.put(response(1), conversation(1))
                got = await store.get("resp_1")
                assert got is not None and got.response == response(1)
                assert got.conversation == conversation(1)
                pid = store.pid
                assert pid is not None and pid != os.getpid() and _alive(pid)
                pids.append(pid)
                os.kill(pid, signal.SIGKILL)
                with pytest.raises(StoreUnavailable) as e:
                    await store.get("resp_1")
                assert e.value.status == 503 and f"pid {pid}" in e.value.message
                assert store.pid is None
                got = await store.get("resp_1")  # a new process, the same file
                assert got is not None and store.pid not in (None, pid)
                pids.append(store.pid)  # type: ignore[arg-type]
                os.kill(store.pid, signal.SIGKILL)  # type: ignore[arg-type]
                with pytest.raises(StoreUnavailable):  # a write finds it gone too
                    await store.put(response(2), conversation(2))
                await store.put(response(2), conversation(2))
                assert await store.delete("resp_1") and await store.get("resp_1") is None
                assert (await store.get("resp_2")) is not None
                pids.append(store.pid)  # type: ignore[arg-type]
        finally:
            store.close()

    anyio.run(main, backend=backend)
    assert not any(_alive(p) for p in pids)  # killed ones reaped, the last closed
    kinds = {"write", "write_trip", "write_send", "write_resume", "write_wait", "read"}
    assert kinds | {"read_wait"} <= set(seen)


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_store_that_cannot_open_its_file_says_so(tmp_path: Path, backend: str) -> None:
    (tmp_path / "file").write_text("")
    store = AsyncResponseStore(tmp_path / "file" / "r.sqlite3", 1 << 20, 3600)

    async def main() -> None:
        try:
            with pytest.raises(StoreError) as e:
                await store.get("resp_1")
            assert e.value.status == 503 and "cannot open the response store" in e.value.message
            assert store.pid is not None  # the process stays, and answers each call so
            with pytest.raises(StoreError):
                await store.put(response(1), conversation(1))
        finally:
            store.close()

    anyio.run(main, backend=backend)


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
    tmp_path: Path, backend: str, cancelled: int
) -> None:
    """While one group commits (held at a gate: this process holds SQLite's write lock,
    so the store process waits in its busy timeout), 8 more puts wait; they commit as
    one group, led by a waiter still there, or by the first leader if every waiter was
    cancelled: no row is lost and nothing hangs. Three commits for ten rows."""
    from anyio import wait_all_tasks_blocked
    from anyio.lowlevel import checkpoint

    path = tmp_path / "r.sqlite3"
    ResponseStore(path, 1 << 20, 3600).close()  # the schema, so the gate can lock it
    seen: list[str] = []
    store = AsyncResponseStore(path, 1 << 20, 3600, lambda k, _s: seen.append(k))

    async def main() -> None:
        await store.get("resp_x")  # the process is up (not part of what is counted)
        gate = sqlite3.connect(path, timeout=30.0)
        gate.execute("BEGIN IMMEDIATE")  # SQLite's write lock, until the commit below
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
                    gate.commit()
                await store.put(response(9), conversation(9))  # and the store goes on
                for i in range(10):
                    assert await store.get(f"resp_{i}") is not None
        finally:
            gate.close()
            store.close()

    anyio.run(main, backend=backend)
    assert seen.count("write") == 3  # commits: [0], [1..8], [9]
    assert seen.count("write_wait") == 10 - cancelled  # every put that returned was timed
