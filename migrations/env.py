"""Alembic environment: runs online against the URL or connection handed in by the caller.

On SQLite a migration is one transaction, DDL included (SQLite supports it, but Python's sqlite3 module only opens
a transaction before INSERT, UPDATE or DELETE, so a CREATE or DROP would otherwise commit on its own), and runs
with foreign keys unenforced: a table copy (Alembic's batch mode) drops the table other tables reference, and
with enforcement on that drop deletes every parent row first, which no deferral survives. Every foreign key is
checked before the commit instead (PRAGMA foreign_key_check), SQLite's documented procedure for rebuilding a
table (https://www.sqlite.org/lang_altertable.html#otheralter): a violation commits nothing.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, Engine, event

from billing.db import make_engine
from billing.models import Base

config = context.config
target_metadata = Base.metadata


def run(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=sqlite,
        transactional_ddl=True if sqlite else None,  # with _one_sqlite_transaction's BEGIN, every DDL too
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()
        if sqlite:
            _check_foreign_keys(connection)


def _check_foreign_keys(connection: Connection) -> None:
    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
    if broken:
        table, rowid, parent, _ = broken[0]
        raise RuntimeError(
            f"migration left {len(broken)} row(s) whose foreign key finds no parent, e.g. {table} rowid {rowid} -> "
            f"{parent}; nothing was committed"
        )


def _one_sqlite_transaction(engine: Engine) -> None:
    """This engine's SQLite connections: foreign keys unenforced, and SQLAlchemy's transaction a real BEGIN."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        dbapi_connection.execute("PRAGMA foreign_keys = OFF")  # after make_engine's ON; outside any transaction
        dbapi_connection.isolation_level = None  # the driver opens no transaction of its own...

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN")  # ...SQLAlchemy's begin is SQLite's


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        run(connection)
        return
    # From code: migrations.upgrade(url). By hand: alembic -c migrations/alembic.ini -x ledger=URL upgrade head
    url = config.attributes.get("ledger_url") or context.get_x_argument(as_dictionary=True).get("ledger")
    if not url:
        raise RuntimeError("no ledger URL: use `zeroqueue migrate --ledger URL` or alembic's -x ledger=URL")
    engine = make_engine(url)
    if engine.dialect.name == "sqlite":
        _one_sqlite_transaction(engine)
    try:
        with engine.connect() as connection:
            run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (--sql) migrations are not supported; run against a database")
run_online()
