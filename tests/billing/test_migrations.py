"""Alembic: upgrade → downgrade → upgrade round trips, and no drift between models and migrations."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import CheckConstraint, inspect, text
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


def revision(filename: str):
    """A migration module under migrations/versions/, loaded from its file (revisions are not a package)."""
    spec = importlib.util.spec_from_file_location(
        Path(filename).stem, migrations.MIGRATIONS_DIR / "versions" / filename
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def declared_checks() -> dict[str, str]:
    """Every CHECK the models declare: its name and expression."""
    return {
        str(constraint.name): str(constraint.sqltext)
        for table in Base.metadata.tables.values()
        for constraint in table.constraints
        if isinstance(constraint, CheckConstraint)
    }


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
                routines = set(
                    connection.execute(
                        text(
                            "SELECT routine_name FROM information_schema.routines"
                            " WHERE routine_schema = current_schema()"
                        )
                    ).scalars()
                )
            else:
                routines = set(
                    connection.execute(text("SELECT name FROM sqlite_master WHERE type = 'trigger'")).scalars()
                )
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
            connection.execute(
                text(
                    "INSERT INTO prices (model, unit, price_micros, currency, effective_from_us, created_at_us) "
                    "VALUES ('m', 'sm_us', 1, 'USD', 0, 0)"
                )
            )
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


# --- 0003: the bounds and the ASCII period hold whoever writes; the page-token secret -------------------------

_INVOICE = text(
    "INSERT INTO invoices (tenant_id, period, status, currency, total_micros, period_start_us, period_end_us, "
    "created_at_us, refreshed_at_us) VALUES (1, :period, 'draft', 'USD', 0, 0, 1, 0, 0)"
)
_USAGE = text(
    "INSERT INTO usage_records (call_id, tenant_id, labels, model, device_kind, device_id, unit, num_units, "
    "unit_us, prompt_tokens, completion_tokens, received_at_us, dispatched_at_us, finished_at_us, deadline_at_us, "
    "deadline_met, outcome, payload_digest, ingested_at_us) VALUES (:call_id, 1, '{}', 'm', 'cpu', 'cpu:h', "
    "'core_us', :num_units, :unit_us, 0, 0, 1, 1, :finished_at_us, 1, false, 'error', 'd', 0)"
)


def secret_of(url: str) -> str:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return connection.execute(text("SELECT secret FROM ledger_secrets WHERE name = 'page_token'")).scalar_one()
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "period", ["２０２６-１２", "٢٠٢٦-١٢", "2026-13", "2026-00", "2026-1", " 2026-1", "2026-1x", "２026-12"]
)
def test_the_database_refuses_a_period_that_is_not_ascii_yyyy_mm(empty_url: str, period: str) -> None:
    migrations.upgrade(empty_url)
    engine = make_engine(empty_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("INSERT INTO tenants (name, created_at_us) VALUES ('acme', 0)"))
            connection.execute(_INVOICE, {"period": "2026-12"})
        with pytest.raises(IntegrityError, match="ck_invoices_period_format"), engine.begin() as connection:
            connection.execute(_INVOICE, {"period": period})
        with pytest.raises(IntegrityError, match="ck_invoices_period_format"), engine.begin() as connection:
            connection.execute(text("UPDATE invoices SET period = :period"), {"period": period})
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "fields, constraint",
    [
        ({"unit_us": 4 * 31 * 86_400_000_000 + 1}, "ck_usage_records_unit_us_range"),
        ({"unit_us": 2**62}, "ck_usage_records_unit_us_range"),
        ({"num_units": 4097}, "ck_usage_records_num_units_range"),
        ({"finished_at_us": 7_258_118_400_000_000}, "ck_usage_records_times_range"),
    ],
)
def test_the_database_refuses_usage_whose_sums_could_overflow(empty_url: str, fields: dict, constraint: str) -> None:
    migrations.upgrade(empty_url)
    engine = make_engine(empty_url)
    row = {"call_id": "r", "num_units": 4, "unit_us": 4 * 31 * 86_400_000_000, "finished_at_us": 2} | fields
    try:
        with engine.begin() as connection:
            connection.execute(text("INSERT INTO tenants (name, created_at_us) VALUES ('acme', 0)"))
            connection.execute(
                _USAGE,
                {"call_id": "at-the-bound", "num_units": 4, "unit_us": 4 * 31 * 86_400_000_000, "finished_at_us": 2},
            )
        with pytest.raises(IntegrityError, match=constraint), engine.begin() as connection:
            connection.execute(_USAGE, row)
    finally:
        engine.dispose()


def test_0003_round_trips_and_will_not_upgrade_over_rows_that_break_its_rules(empty_url: str) -> None:
    migrations.upgrade(empty_url)
    first_secret = secret_of(empty_url)
    assert len(bytes.fromhex(first_secret)) == 32
    migrations.downgrade(empty_url, "0002")
    tables, _ = tables_and_routines(empty_url)
    assert "ledger_secrets" not in tables
    engine = make_engine(empty_url)
    try:
        with engine.begin() as connection:  # without 0003 nothing stops another spelling of a month
            connection.execute(text("INSERT INTO tenants (name, created_at_us) VALUES ('acme', 0)"))
            connection.execute(_INVOICE, {"period": "２０２６-１２"})
        with pytest.raises(RuntimeError, match="1 row.*invoices.*ck_invoices_period_format"):
            migrations.upgrade(empty_url)
        assert "ledger_secrets" not in tables_and_routines(empty_url)[0]  # stopped before changing anything
        with engine.begin() as connection:
            connection.execute(text("DELETE FROM invoices"))  # a draft may be deleted
    finally:
        engine.dispose()
    migrations.upgrade(empty_url)
    assert drift(empty_url) == []
    assert secret_of(empty_url) != first_secret  # a new secret: tokens signed before are refused


def test_the_models_declare_exactly_the_checks_that_0003_installs() -> None:
    declared = declared_checks()
    checks = revision("0003_bounds_and_secrets.py").CHECKS
    installed = {name: expression.format(r="") for _, name, expression, _ in checks}
    assert {name: declared.get(name) for name in installed} == installed
