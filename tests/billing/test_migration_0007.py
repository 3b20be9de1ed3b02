"""Migration 0007 over a ledger with usage and a finalized invoice in it: usage_records.request_kind (existing rows:
plain; the database refuses any other value than the four kinds) and invoice_line_request_kinds (existing lines: one
plain row each, frozen with their invoice), both ways, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError

import migrations
from billing.db import ledger_errors, make_engine, session_factory, unit_of_work
from billing.errors import DataRejected
from billing.invoice_kinds import RequestKindUsage
from billing.invoices import get_invoice
from billing.ledger import IngestStatus, _usage_row, ingest_usage
from billing.records import RequestKind
from tests.billing.conftest import BACKENDS, fresh_postgres_schema
from tests.billing.factories import usage
from tests.billing.test_migration_0005 import _FINALIZE, _INVOICE, _LINES, _PRICES, _TENANT
from tests.billing.test_migration_0006 import insert_before_0006
from tests.billing.test_migrations import declared_checks, drift, revision, tables_and_routines

OLD = usage("call-old")  # stored before kinds: plain
_USAGE = text(
    "INSERT INTO usage_records (call_id, tenant_id, labels, model, device_kind, device_id, unit, num_units, unit_us, "
    "prompt_tokens, completion_tokens, received_at_us, dispatched_at_us, finished_at_us, deadline_at_us, "
    "deadline_met, outcome, payload_digest, ingested_at_us, request_kind) VALUES (:call_id, 1, '{}', 'm', 'cpu', "
    "'cpu:h', 'core_us', 1, 1, 0, 0, 1, 1, 2, 3, true, 'ok', 'd', 0, :request_kind)"
)


def test_the_models_declare_exactly_the_checks_that_0007_installs() -> None:
    declared = declared_checks()
    installed = {name: expression for _, name, expression in revision("0007_request_kinds.py").CHECKS}
    assert {name: declared.get(name) for name in installed} == installed
    assert revision("0007_request_kinds.py").KINDS == tuple(kind.value for kind in RequestKind)


@pytest.fixture(params=BACKENDS)
def at_0006(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A ledger at 0006 holding a tenant, two prices, a finalized invoice of two lines, and a usage record."""
    if request.param == "sqlite":
        yield from _filled(f"sqlite+pysqlite:///{tmp_path / 'ledger.db'}")
        return
    with fresh_postgres_schema() as url:
        yield from _filled(url)


def _filled(url: str) -> Iterator[str]:
    migrations.upgrade(url, "0006")
    engine = make_engine(url)
    row = _usage_row(OLD, 1, OLD.payload_digest(), 0)
    del row["request_kind"], row["door"], row["cached_prompt_tokens"]  # no such columns before 0007 (0008, 0009)
    del row["weight_dtype"]  # nor before 0010
    try:
        with engine.begin() as connection:
            for sql in (_TENANT, _PRICES):
                connection.execute(text(sql))
            connection.execute(text(_INVOICE), {"period": "2026-10"})
            connection.execute(text(_LINES))
            connection.execute(text(_FINALIZE))
            insert_before_0006(connection, row)  # any columns given: those of 0006 here
    finally:
        engine.dispose()
    yield url


def rows(engine: Engine, sql: str) -> list[tuple]:
    with engine.connect() as connection:
        return [tuple(row) for row in connection.execute(text(sql))]


def assert_kinds_guarded(engine: Engine) -> None:
    """The database refuses a request kind it does not know, and a finalized invoice's kinds are frozen."""
    for kind in ("voice", "", "PLAIN"):
        with pytest.raises(IntegrityError, match="ck_usage_records_request_kind"), engine.begin() as connection:
            connection.execute(_USAGE, {"call_id": f"bad-{kind}", "request_kind": kind})
    with pytest.raises(DataRejected) as caught, ledger_errors(), engine.begin() as connection:
        connection.execute(_USAGE, {"call_id": "bad", "request_kind": "voice"})
    assert caught.value.field == "request_kind"
    for sql in (
        "UPDATE invoice_line_request_kinds SET amount_micros = 0",
        "DELETE FROM invoice_line_request_kinds",
        "INSERT INTO invoice_line_request_kinds (invoice_id, position, request_kind, num_requests, unit_us, "
        "prompt_tokens, completion_tokens, amount_micros) VALUES (1, 0, 'chat', 1, 0, 0, 0, 0)",
    ):
        with pytest.raises(IntegrityError, match="refused"), engine.begin() as connection:
            connection.execute(text(sql))


def test_0007_makes_old_rows_plain_and_guards_kinds_both_ways(at_0006: str) -> None:
    before = tables_and_routines(at_0006)
    engine = make_engine(at_0006)
    try:
        migrations.upgrade(at_0006)
        assert drift(at_0006) == []
        assert rows(engine, "SELECT call_id, request_kind FROM usage_records") == [("call-old", "plain")]
        with session_factory(engine)() as session:  # the finalized invoice lists its lines' kinds: all plain
            lines = get_invoice(session, 1).lines
        assert [line.request_kinds for line in lines] == [
            (RequestKindUsage(RequestKind.PLAIN, 1, 1_000_000, 10, 20, 1500),),
            (RequestKindUsage(RequestKind.PLAIN, 1, 750_000, 10, 20, 1500),),
        ]
        assert_kinds_guarded(engine)
        with unit_of_work(session_factory(engine)) as session:
            replays = ingest_usage(session, [OLD, usage("call-old", request_kind="chat")])
        assert [r.status for r in replays] == [IngestStatus.DUPLICATE, IngestStatus.CONFLICT]

        migrations.downgrade(at_0006, "0006")  # every record is plain: nothing is lost
        assert tables_and_routines(at_0006) == before
        assert rows(engine, "SELECT call_id FROM usage_records") == [("call-old",)]

        migrations.upgrade(at_0006)
        assert drift(at_0006) == []
        assert_kinds_guarded(engine)
        with unit_of_work(session_factory(engine)) as session:
            ingest_usage(session, [usage("call-chat", request_kind="chat")])
        with pytest.raises(RuntimeError, match="1 usage record.*request kind other than plain"):
            migrations.downgrade(at_0006, "0006")
        assert rows(engine, "SELECT request_kind FROM usage_records ORDER BY id") == [("plain",), ("chat",)]
        assert drift(at_0006) == []  # still at 0007: the refusal changed nothing
    finally:
        engine.dispose()
