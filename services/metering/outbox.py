"""The durable local outbox between the engine and the ledger.

A usage record is committed here (SQLite, WAL, synchronous=FULL) before the caller's final message goes
out; a shipper then delivers batches to the ledger and marks rows delivered only once the ledger has
acknowledged them (accepted, or a duplicate of what it already holds). A restarted process finds what a
crash left behind and ships it. Conflicts and invalid records are set aside as dead letters, loudly,
never dropped.

A usage row's payload is the record under its frozen zq.usage.v1 keys (billing/records.py V1_USAGE_KEYS), not
under its field names: rows written by a replica before a field was renamed still decode and ship after an
upgrade. A row written before a field was added lacks its key and decodes to the field's default (request_kind:
plain; door: grpc; cached_prompt_tokens: 0; weight_dtype: '', unknown). A record appended again is the row already
held when their payloads are the same record, compared by payload digest (billing/records.py), which an added field
at its default leaves as it was: not a conflict.
"""

from __future__ import annotations

import json
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import structlog

from billing.db import is_default_data_dir
from billing.errors import InvalidRecord
from billing.private_files import private_sqlite
from billing.records import IdleRecord, UsageRecord

log = structlog.get_logger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL CHECK (kind IN ('usage', 'idle')),
    record_id TEXT NOT NULL UNIQUE,
    payload TEXT NOT NULL,
    created_at_us INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    delivered_at_us INTEGER,
    dead_at_us INTEGER
);
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (id) WHERE delivered_at_us IS NULL AND dead_at_us IS NULL;
-- a record whose id the outbox already held with another payload: kept for an operator, never shipped
CREATE TABLE IF NOT EXISTS outbox_conflicts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    record_id TEXT NOT NULL,
    payload TEXT NOT NULL,
    created_at_us INTEGER NOT NULL
);
"""


class OutboxConflict(RuntimeError):
    """The outbox already held a record under this id with another payload: the new one was set aside."""


@dataclass(frozen=True)
class OutboxRow:
    id: int
    record: UsageRecord | IdleRecord


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


def _now_us() -> int:
    return time.time_ns() // 1000


def _decode(kind: str, payload: str) -> UsageRecord | IdleRecord:
    data = json.loads(payload)
    return UsageRecord.from_v1_payload(data) if kind == "usage" else IdleRecord(**data)


def _same_record(kind: str, held: str, payload: str) -> bool:
    """Whether two payloads are one record: equal digests (a row written before a field existed, say)."""
    try:
        return _decode(kind, held).payload_digest() == _decode(kind, payload).payload_digest()
    except (InvalidRecord, TypeError, ValueError):  # a held row that no longer decodes is no match
        return False


class Outbox:
    def __init__(self, path: Path) -> None:
        self.path = path
        private_sqlite(path, narrow_dir=is_default_data_dir(path.parent))  # 0600 from the start, its -wal too
        with _connect(path) as conn:
            conn.executescript(SCHEMA)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._reader = threading.local()
        self.written = threading.Condition()
        self._writer = threading.Thread(target=self._write_loop, name="zeroqueue-outbox", daemon=True)
        self._writer.start()

    # ---- writing: called from the engine thread; a writer thread group-commits ----
    def expect(self, call_id: str) -> Future:
        """A future that resolves with the call's record once it is on disk (or fails with the error
        that kept it off the disk). Ask before the record can be appended; `forget` when no longer waiting."""
        future: Future = Future()
        with self._lock:
            self._futures[call_id] = future
        return future

    def forget(self, call_id: str) -> None:
        with self._lock:
            self._futures.pop(call_id, None)

    def append(self, records: list[Callable[[], UsageRecord]], idle: list[IdleRecord]) -> None:
        """Queues records (each given as a builder, called on the writer thread) for the next group commit;
        returns at once."""
        self._queue.put((records, idle))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Waits until everything appended so far is committed."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def _write_loop(self) -> None:
        conn = _connect(self.path)
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            self._commit(conn, [item for item in items if isinstance(item, tuple)])
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()
            if any(item is None for item in items):
                conn.close()
                return

    def _commit(self, conn: sqlite3.Connection, batch: list) -> None:
        if not batch:
            return
        rows, usage = [], []
        for builders, idle in batch:
            records = [r for r in map(self._build, builders) if r is not None]
            rows += [("usage", r.call_id, json.dumps(r.to_v1_payload()), _now_us()) for r in records]
            rows += [("idle", r.record_id, json.dumps(r.to_payload()), _now_us()) for r in idle]
            usage += records
        error, conflicts = None, set()
        try:
            conn.execute("BEGIN IMMEDIATE")
            conflicts = self._insert(conn, rows)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:  # the disk failed us: callers must not claim success
            log.error("outbox_write_failed", error=str(exc), records=len(rows))
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            error = exc
        for record in usage:
            with self._lock:
                future = self._futures.pop(record.call_id, None)
            if future is None or future.done():
                continue
            if error is not None:
                future.set_exception(error)
            elif record.call_id in conflicts:
                future.set_exception(
                    OutboxConflict(f"usage record {record.call_id} conflicts with one the outbox already holds")
                )
            else:
                future.set_result(record)
        with self.written:
            self.written.notify_all()

    @staticmethod
    def _insert(conn: sqlite3.Connection, rows: list[tuple[str, str, str, int]]) -> set[str]:
        """Inserts each row whose id is new; returns the ids already present with another payload, whose rows
        go to outbox_conflicts. An id already present with the same payload is the same record: no loss."""
        conflicts = set()
        for kind, record_id, payload, created_at_us in rows:
            if conn.execute(
                "INSERT INTO outbox (kind, record_id, payload, created_at_us) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (record_id) DO NOTHING",
                (kind, record_id, payload, created_at_us),
            ).rowcount:
                continue
            (held,) = conn.execute("SELECT payload FROM outbox WHERE record_id = ?", (record_id,)).fetchone()
            if held == payload or _same_record(kind, held, payload):
                log.warning("outbox_duplicate", kind=kind, record_id=record_id)
                continue
            log.error("outbox_conflict", kind=kind, record_id=record_id)
            conn.execute(
                "INSERT INTO outbox_conflicts (kind, record_id, payload, created_at_us) VALUES (?, ?, ?, ?)",
                (kind, record_id, payload, created_at_us),
            )
            conflicts.add(record_id)
        return conflicts

    def _build(self, builder: Callable[[], UsageRecord]) -> UsageRecord | None:
        try:
            return builder()
        except InvalidRecord as exc:  # a bug upstream: fail that call loudly, keep the rest
            call_id = builder.keywords.get("call_id", "?") if hasattr(builder, "keywords") else "?"
            log.error("usage_record_invalid", call_id=call_id, field=exc.field, error=str(exc))
            with self._lock:
                future = self._futures.pop(call_id, None)
            if future is not None:
                future.set_exception(exc)
            return None

    # ---- reading and marking: called from the shipper ----
    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._reader, "conn", None)
        if conn is None:
            conn = self._reader.conn = _connect(self.path)
        return conn

    def pending(self, limit: int) -> list[OutboxRow]:
        rows = (
            self._conn()
            .execute(
                "SELECT id, kind, payload FROM outbox WHERE delivered_at_us IS NULL AND dead_at_us IS NULL "
                "ORDER BY id LIMIT ?",
                (limit,),
            )
            .fetchall()
        )
        return [OutboxRow(row_id, _decode(kind, payload)) for row_id, kind, payload in rows]

    def mark_delivered(self, ids: list[int]) -> None:
        self._update(
            "UPDATE outbox SET delivered_at_us = ?, attempts = attempts + 1 WHERE id = ?", [(_now_us(), i) for i in ids]
        )

    def mark_dead(self, dead: list[tuple[int, str]]) -> None:
        self._update(
            "UPDATE outbox SET dead_at_us = ?, last_error = ?, attempts = attempts + 1 WHERE id = ?",
            [(_now_us(), reason, i) for i, reason in dead],
        )

    def mark_failed(self, ids: list[int], error: str) -> None:
        self._update(
            "UPDATE outbox SET attempts = attempts + 1, last_error = ? WHERE id = ?", [(error, i) for i in ids]
        )

    def _update(self, sql: str, params: list[tuple]) -> None:
        if not params:
            return
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(sql, params)
        conn.execute("COMMIT")

    def counts(self) -> dict[str, int]:
        pending, delivered, dead = (
            self._conn()
            .execute(
                "SELECT COUNT(*) FILTER (WHERE delivered_at_us IS NULL AND dead_at_us IS NULL), "
                "COUNT(delivered_at_us), COUNT(dead_at_us) FROM outbox"
            )
            .fetchone()
        )
        (conflicts,) = self._conn().execute("SELECT COUNT(*) FROM outbox_conflicts").fetchone()
        return {"pending": pending, "delivered": delivered, "dead": dead, "conflicts": conflicts}

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(30)
