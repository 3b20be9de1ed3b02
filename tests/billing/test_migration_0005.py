"""Migration 0005 over a ledger with money in it: prices referenced by invoice lines, usage, a finalized invoice.

SQLite copies the prices table (its unique key changes); the copy must keep every row, the foreign keys of
invoice lines, and prices' triggers (append-only, bounds) both ways.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError

import migrations
from billing.db import ledger_errors, make_engine, session_factory, unit_of_work
from billing.errors import LedgerRefused
from billing.invoices import get_invoice
from billing.ledger import IngestStatus, ingest_usage
from billing.pricing import add_price
from tests.billing.conftest import BACKENDS, fresh_postgres_schema
from tests.billing.factories import START_US, usage
from tests.billing.test_migration_0006 import insert_before_0006, row_before_0006
from tests.billing.test_migrations import drift

_TENANT = "INSERT INTO tenants (name, created_at_us) VALUES ('acme', 0)"
_PRICES = (
    "INSERT INTO prices (model, unit, price_micros, currency, effective_from_us, created_at_us) VALUES "
    "('tiny', 'core_us', 1500, 'USD', 0, 0), ('tiny', 'core_us', 2000, 'USD', 100, 0)"
)
_INVOICE = (
    "INSERT INTO invoices (tenant_id, period, status, currency, total_micros, period_start_us, period_end_us, "
    "created_at_us, refreshed_at_us) VALUES (1, :period, 'draft', 'USD', 3000, 0, 1, 0, 0)"
)
_FINALIZE = "UPDATE invoices SET status = 'finalized', finalized_at_us = 1 WHERE id = 1"
_LINES = (
    "INSERT INTO invoice_lines (invoice_id, position, kind, model, unit, price_id, price_micros, usage_from_us, "
    "usage_to_us, num_requests, unit_us, prompt_tokens, completion_tokens, amount_micros) VALUES "
    "(1, 0, 'usage', 'tiny', 'core_us', 1, 1500, 0, 100, 1, 1000000, 10, 20, 1500), "
    "(1, 1, 'usage', 'tiny', 'core_us', 2, 2000, 100, 1, 1, 750000, 10, 20, 1500)"
)
_ORPHAN_LINE = _LINES.split(" VALUES ")[0] + " VALUES (:i, 0, 'usage', 'm', 'core_us', 99, 1, 0, 1, 1, 1, 0, 0, 1)"


@pytest.fixture(params=BACKENDS)
def at_0004(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A ledger at 0004 holding a tenant, two prices, a finalized invoice whose lines use both, and a record."""
    if request.param == "sqlite":
        url = f"sqlite+pysqlite:///{tmp_path / 'ledger.db'}"
        yield from _filled(url)
        return
    with fresh_postgres_schema() as url:
        yield from _filled(url)


def _filled(url: str) -> Iterator[str]:
    migrations.upgrade(url, "0004")
    engine = make_engine(url)
    row = row_before_0006(usage("r-1"), usage("r-1").payload_digest())
    del row["service_class"]  # no such column before 0005
    try:
        with engine.begin() as connection:
            connection.execute(text(_TENANT))
            connection.execute(text(_PRICES))
            connection.execute(text(_INVOICE), {"period": "2026-10"})
            connection.execute(text(_LINES))
            connection.execute(text(_FINALIZE))
            insert_before_0006(connection, row)
    finally:
        engine.dispose()
    yield url


def scalars(engine: Engine, sql: str) -> list:
    with engine.connect() as connection:
        return list(connection.execute(text(sql)).scalars())


def assert_prices_guarded(engine: Engine) -> None:
    """prices is append-only and bounded, and invoice lines still reference its rows."""
    with pytest.raises(IntegrityError, match="append-only"), engine.begin() as connection:
        connection.execute(text("UPDATE prices SET price_micros = 1 WHERE id = 1"))
    with pytest.raises(IntegrityError, match="append-only"), engine.begin() as connection:
        connection.execute(text("DELETE FROM prices"))
    with pytest.raises(IntegrityError, match="ck_prices_price_range"), engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO prices (model, unit, price_micros, currency, effective_from_us, created_at_us) "
                "VALUES ('big', 'sm_us', 1000000001, 'USD', 0, 0)"
            )
        )
    with pytest.raises(IntegrityError, match="(?i)foreign key"), engine.begin() as connection:  # still enforced
        invoice_id = connection.execute(text(_INVOICE + " RETURNING id"), {"period": "2026-09"}).scalar_one()
        connection.execute(text(_ORPHAN_LINE), {"i": invoice_id})
    assert scalars(engine, "SELECT price_micros FROM prices ORDER BY id") == [1500, 2000]
    assert scalars(engine, "SELECT price_id FROM invoice_lines ORDER BY position") == [1, 2]
    if engine.dialect.name == "sqlite":
        with engine.connect() as connection:
            assert connection.execute(text("PRAGMA foreign_key_check")).all() == []


def test_0005_upgrades_and_downgrades_a_ledger_with_money_in_it(at_0004: str) -> None:
    migrations.upgrade(at_0004)
    engine = make_engine(at_0004)
    try:
        assert drift(at_0004) == []
        assert_prices_guarded(engine)
        assert scalars(engine, "SELECT service_class FROM prices") == ["", ""]
        assert scalars(engine, "SELECT service_class FROM usage_records") == ["standard"]
        assert scalars(engine, "SELECT service_class FROM invoice_lines") == ["standard", "standard"]
        assert scalars(engine, "SELECT name FROM service_classes") == ["standard"]
        sessions = session_factory(engine)
        with unit_of_work(sessions) as session:
            assert [line.service_class for line in get_invoice(session, 1).lines] == ["standard", "standard"]
            # a record stored before 0005, shipped again: the same call, not a conflict
            assert [r.status for r in ingest_usage(session, [usage("r-1")])] == [IngestStatus.DUPLICATE]
        with pytest.raises(LedgerRefused), ledger_errors(), engine.begin() as connection:
            connection.execute(text("DELETE FROM service_classes"))
        migrations.downgrade(at_0004, "0004")
        assert_prices_guarded(engine)
        assert "service_classes" not in scalars(
            engine,
            "SELECT name FROM sqlite_master WHERE type = 'table'"
            if engine.dialect.name == "sqlite"
            else "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()",
        )
        assert scalars(engine, "SELECT request_id FROM usage_records") == ["r-1"]
        migrations.upgrade(at_0004)
        assert_prices_guarded(engine)
        assert drift(at_0004) == []
    finally:
        engine.dispose()


@pytest.mark.parametrize("classed", ["price", "usage"], ids=["a price of a class", "usage of a class"])
def test_0005_will_not_downgrade_over_what_names_a_class(at_0004: str, classed: str) -> None:
    migrations.upgrade(at_0004)
    engine = make_engine(at_0004)
    try:
        with unit_of_work(session_factory(engine)) as session:
            if classed == "price":
                session.execute(
                    text(
                        "INSERT INTO service_classes (name, min_budget_ms, max_budget_ms, priority, credit_ppm, "
                        "created_at_us) VALUES ('batch', 1, 10, 0, 0, 0)"
                    )
                )
                add_price(session, "tiny", "core_us", 1, "USD", START_US, service_class="batch")
            else:
                ingest_usage(session, [usage("r-2", service_class="batch")])
        with pytest.raises(RuntimeError, match="name a class"):
            migrations.downgrade(at_0004, "0004")
        assert drift(at_0004) == []  # refused before anything changed
    finally:
        engine.dispose()


def test_a_sqlite_migration_that_would_leave_a_broken_foreign_key_commits_nothing(tmp_path: Path) -> None:
    url = f"sqlite+pysqlite:///{tmp_path / 'ledger.db'}"
    for _ in _filled(url):
        pass
    engine = make_engine(url)
    try:
        with engine.connect() as connection:  # an orphan written with enforcement off, as an old tool might
            connection.exec_driver_sql("PRAGMA foreign_keys = OFF")
            connection.execute(text(_INVOICE), {"period": "2026-09"})
            connection.execute(text(_ORPHAN_LINE), {"i": 2})
            connection.commit()
        with pytest.raises(RuntimeError, match="invoice_lines rowid 3 -> prices"):
            migrations.upgrade(url)
        assert scalars(engine, "SELECT version_num FROM alembic_version") == ["0004"]
        assert "service_classes" not in scalars(engine, "SELECT name FROM sqlite_master WHERE type = 'table'")
    finally:
        engine.dispose()
