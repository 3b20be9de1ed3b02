"""Alembic environment: runs online against the URL or connection handed in by the caller."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from billing.db import make_engine
from billing.models import Base

config = context.config
target_metadata = Base.metadata


def run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


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
    try:
        with engine.connect() as connection:
            run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (--sql) migrations are not supported; run against a database")
run_online()
