"""Alembic: upgrade → downgrade → upgrade round trips, and no drift between models and migrations."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

import migrations
from billing.db import make_engine
from billing.models import Base
from tests.billing.conftest import BACKENDS, fresh_postgres_schema

TABLES = set(Base.metadata.tables)


@pytest.fixture(params=BACKENDS)
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+pysqlite:///{tmp_path / 'ledger.db'}"
        return
    with fresh_postgres_schema() as url:
        yield url


def drift(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return compare_metadata(MigrationContext.configure(connection), Base.metadata)
    finally:
        engine.dispose()


def tables_and_routines(url: str) -> tuple[set[str], set[str]]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            tables = set(inspect(connection).get_table_names())
            if engine.dialect.name == "postgresql":
                routines = set(connection.execute(text(
                    "SELECT routine_name FROM information_schema.routines WHERE routine_schema = current_schema()"
                )).scalars())
            else:
                routines = set(connection.execute(text(
                    "SELECT name FROM sqlite_master WHERE type = 'trigger'")).scalars())
        return tables, routines
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_round_trip(empty_url: str) -> None:
    migrations.upgrade(empty_url)
    tables, routines = tables_and_routines(empty_url)
    assert tables == TABLES | {"alembic_version"}
    assert routines  # the append-only and immutability triggers (or their functions)
    assert drift(empty_url) == []

    migrations.downgrade(empty_url, "base")
    assert tables_and_routines(empty_url) == ({"alembic_version"}, set())

    migrations.upgrade(empty_url)
    assert tables_and_routines(empty_url) == (tables, routines)
    assert drift(empty_url) == []
    engine = make_engine(empty_url)
    try:
        with pytest.raises(IntegrityError, match="append-only"), engine.begin() as connection:
            connection.execute(text(
                "INSERT INTO prices (model, unit, price_micros, currency, effective_from_us, created_at_us) "
                "VALUES ('m', 'sm_us', 1, 'USD', 0, 0)"))
            connection.execute(text("UPDATE prices SET price_micros = 2"))
    finally:
        engine.dispose()


def test_the_drift_check_sees_a_schema_the_models_do_not_describe(empty_url: str) -> None:
    migrations.upgrade(empty_url)
    engine = make_engine(empty_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("ALTER TABLE tenants ADD COLUMN rogue INTEGER"))
    finally:
        engine.dispose()
    assert [change[0] for change in drift(empty_url)] == ["remove_column"]
