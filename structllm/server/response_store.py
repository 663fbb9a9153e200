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
busy timeout, so the processes wait for each other's writes rather than fail). A front
end does not run it: its store process does (``store_process``), driven through
``store_client.AsyncResponseStore``; rows cross as ``StoreRow``/``StoredRow``, their JSON
encoded and decoded in the front end (``encode_row``, ``decode_row``).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from structllm.protocol import StoredRow, StoreRow

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


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    engine_request_id: str | None
    cancel_requested: bool
    owner_pid: int | None = None  # the process running it (a background run not ended)
    events: list[dict[str, Any]] | None = None  # a background run's, once it has ended


def encode_row(
    response: dict[str, Any],
    conversation: list[dict[str, Any]],
    engine_request_id: str | None = None,
    owner_pid: int | None = None,
    events: list[dict[str, Any]] | None = None,
) -> StoreRow:
    """One ``put``'s row, its JSON encoded (msgspec: several times json's speed)."""
    return StoreRow(
        response["id"],
        response["status"],
        msgspec.json.encode(response),
        msgspec.json.encode(conversation),
        engine_request_id,
        owner_pid,
        None if events is None else msgspec.json.encode(events),
    )


def decode_row(row: StoredRow) -> Stored:
    events = None if row.events is None else msgspec.json.decode(row.events)
    return Stored(
        msgspec.json.decode(row.response),
        msgspec.json.decode(row.conversation),
        row.engine_request_id,
        row.cancel_requested,
        row.owner_pid,
        events,
    )


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
        self.put_rows([encode_row(response, conversation, engine_request_id, owner_pid, events)])

    def put_rows(self, rows: list[StoreRow]) -> None:
        """Insert or replace each row, in one transaction (one commit), then evict once."""
        now = time.time()
        params = [
            (
                r.id,
                now,
                now + self.ttl,
                r.status,
                r.response,
                r.conversation,
                r.engine_request_id,
                r.owner_pid,
                len(r.response) + len(r.conversation) + len(r.events or b""),
                r.events,
            )
            for r in rows
        ]
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
        row = self.request_cancel_row(response_id)
        return None if row is None else decode_row(row)

    def request_cancel_row(self, response_id: str) -> StoredRow | None:
        with self._lock, self._db:
            self._db.execute(
                "UPDATE responses SET cancel_requested = 1 WHERE id = ?", (response_id,)
            )
            return self._get(response_id)

    # -- reads -------------------------------------------------------------------------

    def get(self, response_id: str) -> Stored | None:
        row = self.get_row(response_id)
        return None if row is None else decode_row(row)

    def get_row(self, response_id: str) -> StoredRow | None:
        with self._lock:
            return self._get(response_id)

    def _get(self, response_id: str) -> StoredRow | None:
        row = self._db.execute(
            "SELECT response, conversation, engine_request_id, cancel_requested, owner_pid, "
            "events FROM responses WHERE id = ? AND expires_at > ?",
            (response_id, time.time()),
        ).fetchone()
        if row is None:
            return None
        # TEXT columns written as bytes come back as str: the stored JSON, re-encoded
        body, conv, events = (
            x.encode() if isinstance(x, str) else x for x in (row[0], row[1], row[5])
        )
        return StoredRow(body, conv, row[2], bool(row[3]), row[4], events)

    def total_size(self) -> int:
        with self._lock:
            return self.total_size_locked()

    def total_size_locked(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'total_size'").fetchone()
        return int(row[0])

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])
