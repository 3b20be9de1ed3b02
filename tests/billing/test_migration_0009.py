"""Migration 0009 over a ledger with usage and a finalized invoice in it: cached_prompt_tokens on usage_records,
invoice_lines and invoice_line_request_kinds (existing rows: 0; the database refuses a count outside [0,
prompt_tokens]), both ways, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import IntegrityError

import migrations
from billing.db import ledger_errors, make_engine, session_factory, unit_of_work
from billing.errors import DataRejected
from billing.invoices import get_invoice
from billing.ledger import IngestStatus, _usage_row, ingest_usage
from tests.billing.conftest import BACKENDS, fresh_postgres_schema
from tests.billing.factories import usage
from tests.billing.test_migration_0005 import _FINALIZE, _INVOICE, _LINES, _PRICES, _TENANT
from tests.billing.test_migration_0006 import insert_before_0006
from tests.billing.test_migrations import declared_checks, drift, revision, tables_and_routines

OLD = usage("call-old", door="http")  # stored before the prefix cache: nothing was served to it (prompt_tokens 10)
TABLES = ("usage_records", "invoice_lines", "invoice_line_request_kinds")
_USAGE = text(
    "INSERT INTO usage_records (call_id, tenant_id, labels, model, device_kind, device_id, unit, num_units, unit_us, "
    "prompt_tokens, completion_tokens, received_at_us, dispatched_at_us, finished_at_us, deadline_at_us, "
    "deadline_met, outcome, payload_digest, ingested_at_us, cached_prompt_tokens) VALUES (:call_id, 1, '{}', 'm', "
    "'cpu', 'cpu:h', 'core_us', 1, 1, 10, 0, 1, 1, 2, 3, true, 'ok', 'd', 0, :cached)"
)
_DRAFT = (  # a draft for another month, whose lines may still be written (its id given: a sequence never rolls back)
    "INSERT INTO invoices (id, tenant_id, period, status, currency, total_micros, period_start_us, period_end_us, "
    "created_at_us, refreshed_at_us) VALUES (2, 1, '2026-11', 'draft', 'USD', 0, 0, 1, 0, 0)"
)
_DRAFT_LINE = text(
    "INSERT INTO invoice_lines (invoice_id, position, kind, model, unit, price_id, price_micros, usage_from_us, "
    "usage_to_us, num_requests, unit_us, prompt_tokens, completion_tokens, amount_micros, cached_prompt_tokens) "
    "VALUES (2, 0, 'usage', 'tiny', 'core_us', 1, 1500, 0, 1, 1, 1, 10, 0, 0, :cached)"
)
_DRAFT_KIND = text(
    "INSERT INTO invoice_line_request_kinds (invoice_id, position, request_kind, num_requests, unit_us, "
    "prompt_tokens, completion_tokens, amount_micros, cached_prompt_tokens) VALUES (2, 0, 'plain', 1, 1, 10, 0, 0, "
    ":cached)"
)


def test_the_models_declare_exactly_the_checks_that_0009_installs() -> None:
    declared = declared_checks()
    installed = {name: expression for _, name, expression in revision("0009_cached_prompt_tokens.py").CHECKS}
    expression = "cached_prompt_tokens >= 0 AND cached_prompt_tokens <= prompt_tokens"
    assert installed == {f"ck_{table}_cached_prompt_tokens": expression for table in TABLES}
    assert {name: declared.get(name) for name in installed} == installed


@pytest.fixture(params=BACKENDS)
def at_0008(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A ledger at 0008 holding a tenant, two prices, a finalized invoice of two lines (and their kinds), and a usage
    record."""
    if request.param == "sqlite":
        yield from _filled(f"sqlite+pysqlite:///{tmp_path / 'ledger.db'}")
        return
    with fresh_postgres_schema() as url:
        yield from _filled(url)


def _filled(url: str) -> Iterator[str]:
    migrations.upgrade(url, "0006")
    engine = make_engine(url)
    row = _usage_row(OLD, 1, OLD.payload_digest(), 0)
    del row["cached_prompt_tokens"], row["weight_dtype"]  # no such columns before 0009 (and 0010)
    try:
        with engine.begin() as connection:
            for sql in (_TENANT, _PRICES):
                connection.execute(text(sql))
            connection.execute(text(_INVOICE), {"period": "2026-10"})
            connection.execute(text(_LINES))
            connection.execute(text(_FINALIZE))
        migrations.upgrade(url, "0008")  # 0007 gives the finalized lines their kinds
        with engine.begin() as connection:
            insert_before_0006(connection, row)  # any columns given: those of 0008 here
    finally:
        engine.dispose()
    yield url


def rows(engine: Engine, sql: str) -> list[tuple]:
    with engine.connect() as connection:
        return [tuple(row) for row in connection.execute(text(sql))]


def cached_columns(engine: Engine) -> dict[str, bool]:
    inspector = inspect(engine)
    return {table: "cached_prompt_tokens" in {c["name"] for c in inspector.get_columns(table)} for table in TABLES}


def assert_counts_guarded(engine: Engine) -> None:
    """The database refuses a count below 0 or above the row's prompt_tokens (10), naming the field on a usage
    record; it takes 0 and all ten. A finalized invoice's counts are frozen with it."""
    for table, statement in (("usage_records", _USAGE), ("invoice_lines", _DRAFT_LINE)):
        for cached in (-1, 11):
            with pytest.raises(IntegrityError, match=f"ck_{table}_cached_prompt_tokens"), engine.begin() as connection:
                connection.execute(text(_DRAFT))
                connection.execute(statement, {"call_id": f"bad-{cached}", "cached": cached})
    with pytest.raises(IntegrityError, match="ck_invoice_line_request_kinds_cached"), engine.begin() as connection:
        connection.execute(text(_DRAFT))
        connection.execute(_DRAFT_LINE, {"cached": 10})
        connection.execute(_DRAFT_KIND, {"cached": 11})
    with pytest.raises(DataRejected) as caught, ledger_errors(), engine.begin() as connection:
        connection.execute(_USAGE, {"call_id": "bad", "cached": 11})
    assert caught.value.field == "cached_prompt_tokens"
    with engine.connect() as connection:  # the statements are sound: with a count in range they go in
        connection.execute(text(_DRAFT))
        for cached in (0, 10):
            connection.execute(_USAGE, {"call_id": f"good-{cached}", "cached": cached})
        connection.execute(_DRAFT_LINE, {"cached": 10})
        connection.execute(_DRAFT_KIND, {"cached": 10})
        connection.rollback()  # leaves the ledger as it was
    for sql in (
        "UPDATE invoice_lines SET cached_prompt_tokens = 1 WHERE invoice_id = 1",
        "UPDATE invoice_line_request_kinds SET cached_prompt_tokens = 1 WHERE invoice_id = 1",
    ):
        with pytest.raises(IntegrityError, match="refused"), engine.begin() as connection:
            connection.execute(text(sql))


def test_0009_makes_old_rows_0_and_guards_counts_both_ways(at_0008: str) -> None:
    before = tables_and_routines(at_0008)
    engine = make_engine(at_0008)
    try:
        migrations.upgrade(at_0008)
        assert drift(at_0008) == []
        assert rows(engine, "SELECT call_id, door, prompt_tokens, cached_prompt_tokens FROM usage_records") == [
            ("call-old", "http", 10, 0)
        ]
        with session_factory(engine)() as session:  # the finalized invoice: as it was, no token served by a cache
            invoice = get_invoice(session, 1)
        assert [(line.amount_micros, line.prompt_tokens, line.cached_prompt_tokens) for line in invoice.lines] == [
            (1500, 10, 0),
            (1500, 10, 0),
        ]
        assert [kind.cached_prompt_tokens for line in invoice.lines for kind in line.request_kinds] == [0, 0]
        assert_counts_guarded(engine)
        with unit_of_work(session_factory(engine)) as session:  # stored before the cache: still the same record
            replays = ingest_usage(session, [OLD, usage("call-old", door="http", cached_prompt_tokens=4)])
        assert [r.status for r in replays] == [IngestStatus.DUPLICATE, IngestStatus.CONFLICT]

        migrations.downgrade(at_0008, "0008")  # no record was served by the cache: nothing is lost
        assert tables_and_routines(at_0008) == before
        assert cached_columns(engine) == dict.fromkeys(TABLES, False)
        assert rows(engine, "SELECT call_id, door FROM usage_records") == [("call-old", "http")]

        migrations.upgrade(at_0008)
        assert drift(at_0008) == []
        assert_counts_guarded(engine)
        with unit_of_work(session_factory(engine)) as session:
            ingest_usage(session, [usage("call-cached", cached_prompt_tokens=4)])
        with pytest.raises(RuntimeError, match="1 usage record.*prefix cache served prompt tokens"):
            migrations.downgrade(at_0008, "0008")
        assert rows(engine, "SELECT cached_prompt_tokens FROM usage_records ORDER BY id") == [(0,), (4,)]
        assert cached_columns(engine) == dict.fromkeys(TABLES, True)
        assert drift(at_0008) == []  # still at 0009: the refusal changed nothing
    finally:
        engine.dispose()
