"""Engines, sessions and the unit of work: the only place in zeroqueue that commits."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000
LEDGER_FILE = "ledger.db"


def data_dir() -> Path:
    """The data directory: ``$ZEROQUEUE_HOME`` or ``~/.zeroqueue`` (ledger and outbox live here)."""
    home = os.environ.get("ZEROQUEUE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".zeroqueue"


def default_ledger_url() -> str:
    """$ZEROQUEUE_LEDGER_URL (so a password need not be on a command line), else the SQLite file in the
    data directory."""
    return os.environ.get("ZEROQUEUE_LEDGER_URL") or f"sqlite+pysqlite:///{data_dir() / LEDGER_FILE}"


def make_engine(url: str, *, sqlite_synchronous: str = "FULL", **kwargs: object) -> Engine:
    """An engine for the ledger.

    SQLite gets WAL, enforced foreign keys, a busy timeout so concurrent
    writers wait instead of failing, and ``synchronous=FULL`` by default: an
    acknowledged ingest must survive power loss, or the outbox would drop a
    record it believes delivered.  PostgreSQL uses psycopg 3.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, sqlite_synchronous, kwargs)
    if parsed.get_backend_name() == "postgresql" and parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return create_engine(parsed, pool_pre_ping=True, **kwargs)  # type: ignore[arg-type]


def _sqlite_engine(parsed, synchronous: str, kwargs: dict) -> Engine:  # type: ignore[no-untyped-def]
    if synchronous not in ("FULL", "NORMAL", "EXTRA"):
        raise ValueError(f"sqlite_synchronous must be FULL, NORMAL or EXTRA, got {synchronous!r}")
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute(f"PRAGMA synchronous = {synchronous}")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def unit_of_work(factory: sessionmaker[Session]) -> Iterator[Session]:
    """Open a session, commit it if the block succeeds, roll it back if it raises."""
    with factory() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
