"""Engines, sessions and the unit of work: the only place in zeroqueue that commits; and the one map from the
database driver's errors to typed billing errors (:func:`ledger_errors`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from billing.errors import BillingError, DataRejected, LedgerConflict, LedgerRefused, LedgerUnavailable
from billing.private_files import private_sqlite

SQLITE_BUSY_TIMEOUT_MS = 30_000
LEDGER_FILE = "ledger.db"


def default_data_dir() -> Path:
    """~/.zeroqueue: made by zeroqueue (0700 now, 0755 by older versions), so it is narrowed when found open."""
    return Path.home() / ".zeroqueue"


def is_default_data_dir(path: Path) -> bool:
    try:
        return path.expanduser().absolute() == default_data_dir().absolute()
    except RuntimeError:  # no home directory to be found (no $HOME, no passwd entry)
        return False


def data_dir() -> Path:
    """The data directory: ``$ZEROQUEUE_HOME`` or ``~/.zeroqueue`` (ledger and outbox live here)."""
    home = os.environ.get("ZEROQUEUE_HOME")
    return Path(home).expanduser() if home else default_data_dir()


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
    if parsed.database and parsed.database != ":memory:" and not parsed.query.get("uri"):
        path = Path(parsed.database).expanduser()
        # 0600 before SQLite makes it (its -wal and -shm copy that); a new directory is 0700
        private_sqlite(path, narrow_dir=is_default_data_dir(path.parent))
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


# --- the driver's errors as billing errors -----------------------------------------------------------------------
# Outages (a refused or dropped connection, a pool or lock timeout, a serialization failure or deadlock: psycopg
# and sqlite3 raise OperationalError for them all) may be retried: nothing was committed. A value the database
# refuses (DataError: out of a column's range, NUL in text; a CHECK) is the request's fault. Anything else (a
# ProgrammingError, say) is a bug and stays what it is.

# SQLSTATE (PostgreSQL) or extended result code (SQLite) of an IntegrityError -> what it means
_UNIQUE = {"23505", "SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY"}
_REFUSED = {"23001", "SQLITE_CONSTRAINT_TRIGGER"}  # the append-only and finalized-invoice triggers
# A CHECK names the field it guards, the field billing/records.py names for the same rule (SQLite's check
# triggers of migrations 0003 and 0004 say "CHECK constraint failed: …")
CONSTRAINT_FIELDS = {
    "ck_invoices_period_format": "period",
    "ck_usage_records_unit_us_range": "unit_us",
    "ck_usage_records_num_units_range": "num_units",
    "ck_usage_records_tokens_range": "prompt_tokens",
    "ck_usage_records_times_range": "finished_at_us",
    "ck_usage_records_unit_of_device_kind": "unit",
    "ck_usage_records_device_id_of_kind": "device_id",
    "ck_usage_records_deadline_met_on_time": "deadline_met",
    "ck_usage_records_deadline_exceeded_not_met": "deadline_met",
    "ck_usage_records_ok_deadline_met_is_on_time": "deadline_met",
    "ck_usage_records_request_kind": "request_kind",
    "ck_usage_records_door": "door",
    "ck_usage_records_cached_prompt_tokens": "cached_prompt_tokens",
    "ck_idle_records_num_units_range": "num_units",
    "ck_idle_records_minute_range": "minute_start_us",
    "ck_idle_records_wall_range": "wall_unit_us",
    "ck_idle_records_device_id_of_unit": "device_id",
    "ck_prices_price_range": "price_micros",
}
MAX_DETAIL_CHARS = 200


def ledger_error(error: BaseException) -> BillingError | None:
    """The billing error that `error`, raised by SQLAlchemy, means; None for one that is a bug."""
    if isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated:
        return LedgerUnavailable("the ledger database dropped the connection; nothing was stored, retry")
    if isinstance(error, sa_exc.OperationalError) and _detail(error).startswith("integer overflow"):
        return DataRejected("the ledger refused a value: integer overflow")  # SQLite's arithmetic, not an outage
    if isinstance(
        error, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError, sa_exc.DisconnectionError)
    ):
        return LedgerUnavailable("the ledger database is unavailable; nothing was stored, retry")
    if isinstance(error, sa_exc.DataError):
        return DataRejected(f"the ledger refused a value: {_detail(error)}")
    if isinstance(error, sa_exc.IntegrityError):
        code, detail = _code(error), _detail(error)
        constraint = _constraint(error, detail)
        if constraint in CONSTRAINT_FIELDS:
            field = CONSTRAINT_FIELDS[constraint]
            return DataRejected(f"{field}: the ledger refused it ({constraint})", field=field)
        if code in _UNIQUE:
            return LedgerConflict(f"a concurrent write stored the same key first: {detail}")
        if code in _REFUSED:
            return LedgerRefused(f"the ledger refused the change: {detail}")
        return DataRejected(f"the ledger refused a value: {detail}")
    return None


@contextmanager
def ledger_errors() -> Iterator[None]:
    """Raises the billing error that a SQLAlchemy error inside the block means (see :func:`ledger_error`)."""
    try:
        yield
    except sa_exc.SQLAlchemyError as error:
        translated = ledger_error(error)
        if translated is None:
            raise
        raise translated from error


def _detail(error: sa_exc.SQLAlchemyError) -> str:
    """The driver's first line, never the statement or its parameters (another row's values can be there)."""
    orig = getattr(error, "orig", None) or error
    lines = str(orig).strip().splitlines()
    text = lines[0] if lines else type(orig).__name__
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + "…"


def _code(error: sa_exc.DBAPIError) -> str:
    orig = error.orig
    return getattr(orig, "sqlstate", None) or getattr(orig, "sqlite_errorname", None) or ""


def _constraint(error: sa_exc.DBAPIError, detail: str) -> str:
    diag = getattr(error.orig, "diag", None)
    name = getattr(diag, "constraint_name", None)
    if name:
        return name
    marker = "CHECK constraint failed: "
    return detail.split(marker, 1)[1].strip() if marker in detail else ""
