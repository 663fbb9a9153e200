"""Stored responses (``store: true``): a SQLite database through the standard library.

One file, shared by every front-end process of a server (``--api-server-count``) and
kept across restarts. Each row is one response: its object (JSON, as ``GET`` returns
it), its input conversation (the items it was generated from: the stored history of
``previous_response_id``, then its own ``input``), for a background run its events once
it has ended (what ``GET ?stream=true`` replays), and for a background run still going,
the engine request id, the process that runs it, and whether a cancel was asked for.

Bounded two ways, oldest first: rows past their time to live are gone (never read, and
deleted on the next write), and after each write the oldest rows are deleted until the
rows' total size fits ``max_bytes`` (the total is kept by triggers in one ``meta`` row,
so the bound holds across processes without a scan).

``ResponseStore`` is synchronous (one connection, one lock; SQLite in WAL mode with a
busy timeout, so the processes wait for each other's writes rather than fail);
``AsyncResponseStore`` runs each call in a worker thread, never on the event loop.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, TypeVarTuple

import msgspec

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    status TEXT NOT NULL,
    response TEXT NOT NULL,
    conversation TEXT NOT NULL,
    engine_request_id TEXT,
    owner_pid INTEGER,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    size INTEGER NOT NULL,
    events TEXT
);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires_at);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('total_size', 0);
CREATE TRIGGER IF NOT EXISTS responses_ins AFTER INSERT ON responses BEGIN
    UPDATE meta SET value = value + NEW.size WHERE key = 'total_size';
END;
CREATE TRIGGER IF NOT EXISTS responses_del AFTER DELETE ON responses BEGIN
    UPDATE meta SET value = value - OLD.size WHERE key = 'total_size';
END;
CREATE TRIGGER IF NOT EXISTS responses_upd AFTER UPDATE OF size ON responses BEGIN
    UPDATE meta SET value = value + NEW.size - OLD.size WHERE key = 'total_size';
END;
"""

EVICT_BATCH = 64  # rows read per round while evicting
EXPIRY_SWEEP_S = 10.0  # expired rows are deleted at most this often (per connection)

# one ``put``: response, conversation, engine request id, owner pid, events
Row = tuple[
    dict[str, Any], list[dict[str, Any]], str | None, int | None, list[dict[str, Any]] | None
]

Ts = TypeVarTuple("Ts")
R = TypeVar("R")


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    engine_request_id: str | None
    cancel_requested: bool
    owner_pid: int | None = None  # the process running it (a background run not ended)
    events: list[dict[str, Any]] | None = None  # a background run's, once it has ended


def encode(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


class ResponseStore:
    """The database at ``path`` (created with its directory if missing). Thread-safe."""

    def __init__(self, path: str | Path, max_bytes: int, ttl: float) -> None:
        self.path = Path(path)
        self.max_bytes, self.ttl = max_bytes, ttl
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._swept = 0.0  # when expired rows were last deleted
        # autocommit off: each method is one transaction (``with self._db``)
        self._db = sqlite3.connect(self.path, timeout=30.0, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        with self._db:
            self._db.executescript(SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(responses)")}
            if "owner_pid" not in columns:  # a file from before background owners were kept
                self._db.execute("ALTER TABLE responses ADD COLUMN owner_pid INTEGER")
            if "events" not in columns:  # a file from before background events were kept
                self._db.execute("ALTER TABLE responses ADD COLUMN events TEXT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writes ------------------------------------------------------------------------

    def put(
        self,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        engine_request_id: str | None = None,
        owner_pid: int | None = None,
        events: list[dict[str, Any]] | None = None,
    ) -> None:
        """Insert or replace the response (by its ``id``), then evict."""
        self.put_many([(response, conversation, engine_request_id, owner_pid, events)])

    def put_many(self, rows: list[Row]) -> None:
        """``put`` of each row, in one transaction (one commit), then evict once."""
        now = time.time()
        params = []
        for response, conversation, engine_request_id, owner_pid, events in rows:
            # JSON bytes (msgspec: several times json's speed, and this thread holds the
            # GIL while it encodes); SQLite keeps them as they are
            body, conv = encode(response), encode(conversation)
            evs = None if events is None else encode(events)
            params.append(
                (
                    response["id"],
                    now,
                    now + self.ttl,
                    response["status"],
                    body,
                    conv,
                    engine_request_id,
                    owner_pid,
                    len(body) + len(conv) + len(evs or b""),
                    evs,
                )
            )
        with self._lock, self._db:
            self._db.executemany(
                "INSERT INTO responses (id, created_at, expires_at, status, response, "
                "conversation, engine_request_id, owner_pid, size, events) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET status = excluded.status, "
                "response = excluded.response, conversation = excluded.conversation, "
                "engine_request_id = excluded.engine_request_id, "
                "owner_pid = excluded.owner_pid, size = excluded.size, "
                "events = excluded.events",
                params,
            )
            self._evict(now)

    def _evict(self, now: float) -> None:
        # expired rows are never read; deleting them can wait (one statement less per
        # commit: each takes the GIL again, a wait when the event loop's thread is busy)
        if now - self._swept >= EXPIRY_SWEEP_S:
            self._db.execute("DELETE FROM responses WHERE expires_at <= ?", (now,))
            self._swept = now
        total = self.total_size_locked()
        while total > self.max_bytes:
            rows = self._db.execute(
                "SELECT seq, size FROM responses ORDER BY seq LIMIT ?", (EVICT_BATCH,)
            ).fetchall()
            if not rows:
                return
            gone = []
            for seq, size in rows:
                if total <= self.max_bytes:
                    break
                gone.append((seq,))
                total -= size
            self._db.executemany("DELETE FROM responses WHERE seq = ?", gone)

    def delete(self, response_id: str) -> bool:
        with self._lock, self._db:
            cur = self._db.execute(
                "DELETE FROM responses WHERE id = ? AND expires_at > ?", (response_id, time.time())
            )
            return cur.rowcount > 0

    def request_cancel(self, response_id: str) -> Stored | None:
        """Mark a background run as to be cancelled; the row as it is then (None if
        there is none)."""
        with self._lock, self._db:
            self._db.execute(
                "UPDATE responses SET cancel_requested = 1 WHERE id = ?", (response_id,)
            )
            return self._get(response_id)

    # -- reads -------------------------------------------------------------------------

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            return self._get(response_id)

    def _get(self, response_id: str) -> Stored | None:
        row = self._db.execute(
            "SELECT response, conversation, engine_request_id, cancel_requested, owner_pid, "
            "events FROM responses WHERE id = ? AND expires_at > ?",
            (response_id, time.time()),
        ).fetchone()
        if row is None:
            return None
        events = None if row[5] is None else msgspec.json.decode(row[5])
        return Stored(
            msgspec.json.decode(row[0]),
            msgspec.json.decode(row[1]),
            row[2],
            bool(row[3]),
            row[4],
            events,
        )

    def total_size(self) -> int:
        with self._lock:
            return self.total_size_locked()

    def total_size_locked(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'total_size'").fetchone()
        return int(row[0])

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])


def _timed_put_many(store: ResponseStore, rows: list[Row]) -> float:
    """``store.put_many(rows)``; the seconds it took (in its thread)."""
    t = time.perf_counter()
    store.put_many(rows)
    return time.perf_counter() - t


@dataclass(eq=False)
class _Put:
    """One ``AsyncResponseStore.put`` waiting for its commit. ``wake`` is set when it is
    done or when its task is to lead the next group (``lead``)."""

    row: Row
    wake: Any  # anyio.Event
    done: bool = False
    lead: bool = False
    gone: bool = False  # its task was cancelled while waiting (its row is still written)
    error: Exception | None = None


class AsyncResponseStore:
    """``ResponseStore``'s calls in worker threads, never on the event loop, on two
    connections: one for reads, one for writes (WAL: reads do not wait for writes).

    Writes commit in groups: a ``put`` that finds no write in flight leads: it writes
    every pending row in one transaction, in a thread, and hands the lead to a task whose
    row came meanwhile (the rows of tasks cancelled while waiting are written all the
    same); the others wait for their group's commit. So N responses ending in the same
    engine step cost one or two commits, not N in a queue. ``observe(kind, seconds)``
    gets each commit's and read's time in its thread (``kind`` write, read) and each
    call's time as its request waited for it (write_wait, read_wait).
    Opened on first use, in a thread."""

    def __init__(
        self,
        path: str | Path,
        max_bytes: int,
        ttl: float,
        observe: Callable[[str, float], None] | None = None,
    ) -> None:
        self.path, self.max_bytes, self.ttl = Path(path), max_bytes, ttl
        self.observe = observe or (lambda _kind, _s: None)
        self._store: ResponseStore | None = None  # writes
        self._reader: ResponseStore | None = None
        self._limiter: Any = None
        self._read_limiter: Any = None
        self._pending: list[_Put] = []
        self._writing = False  # a task leads a group now (or has been handed the lead)

    def _open(self) -> ResponseStore:
        if self._store is None:
            self._store = ResponseStore(self.path, self.max_bytes, self.ttl)
        return self._store

    def _open_reader(self) -> ResponseStore:
        if self._reader is None:
            self._open()  # the writer makes the file and its schema first
            self._reader = ResponseStore(self.path, self.max_bytes, self.ttl)
        return self._reader

    async def call(self, fn: Callable[[ResponseStore, *Ts], R], *args: *Ts) -> R:
        """``fn(store, *args)`` on the write connection, in a thread."""
        import anyio  # the front end's loop (this module is also used synchronously)

        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)

        def run() -> R:
            return fn(self._open(), *args)

        return await anyio.to_thread.run_sync(run, limiter=self._limiter)

    async def put(
        self,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        engine_request_id: str | None = None,
        owner_pid: int | None = None,
        events: list[dict[str, Any]] | None = None,
    ) -> None:
        import anyio

        start = time.perf_counter()
        w = _Put((response, conversation, engine_request_id, owner_pid, events), anyio.Event())
        self._pending.append(w)
        try:
            if self._writing:
                await w.wake.wait()
            else:
                self._writing = w.lead = True
        finally:
            if w.lead and not w.done:  # cancelled or not, a leader writes its group
                with anyio.CancelScope(shield=True):
                    await self._write_groups()
            elif not w.done:
                w.gone = True
        if w.error is not None:
            raise w.error
        self.observe("write_wait", time.perf_counter() - start)

    async def _write_groups(self) -> None:
        """Commit the pending rows, group after group, until a waiting task can take the
        lead or none is left."""
        handed = False
        try:
            while self._pending and not handed:
                group, self._pending = self._pending, []
                try:
                    took = await self.call(_timed_put_many, [w.row for w in group])
                    self.observe("write", took)
                except Exception as e:  # each waiter raises it
                    for w in group:
                        w.error = e
                for w in group:
                    w.done = True
                    w.wake.set()
                nxt = next((w for w in self._pending if not w.gone), None)
                if nxt is not None:
                    nxt.lead = handed = True
                    nxt.wake.set()
        finally:
            if not handed:
                self._writing = False

    async def get(self, response_id: str) -> Stored | None:
        import anyio

        if self._read_limiter is None:
            self._read_limiter = anyio.CapacityLimiter(1)
        start = time.perf_counter()

        def run() -> tuple[Stored | None, float]:
            store = self._open_reader()
            t = time.perf_counter()
            return store.get(response_id), time.perf_counter() - t

        found, took = await anyio.to_thread.run_sync(run, limiter=self._read_limiter)
        self.observe("read", took)
        self.observe("read_wait", time.perf_counter() - start)
        return found

    async def delete(self, response_id: str) -> bool:
        return await self.call(ResponseStore.delete, response_id)

    async def request_cancel(self, response_id: str) -> Stored | None:
        return await self.call(ResponseStore.request_cancel, response_id)

    def close(self) -> None:
        for store in (self._store, self._reader):
            if store is not None:
                store.close()
        self._store = self._reader = None
