"""Migration 0006 over a ledger with usage in it: usage_records.request_id becomes call_id (the call's own id),
client_request_id becomes request_id (the caller's), and the unique constraint follows.

SQLite copies usage_records (a constraint cannot be renamed in place); the copy must keep every row and the
table's triggers (append-only, bounds, cross-column rules) both ways. A record stored before the rename and
shipped again after it is the same record: DUPLICATE, not CONFLICT.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import JSON, Connection, Engine, text
from sqlalchemy.exc import IntegrityError

import migrations
from billing.db import make_engine, session_factory, unit_of_work
from billing.ledger import IngestStatus, _usage_row, ingest_usage
from billing.records import UsageRecord
from tests.billing.conftest import BACKENDS, fresh_postgres_schema
from tests.billing.factories import usage
from tests.billing.test_migrations import drift, tables_and_routines
from tests.billing.test_records import DIGESTS_BEFORE_THE_RENAME

# a record with the caller's request_id beside its own, and its digest as the code before the rename computed it
OLD_FIELDS, OLD_DIGEST = DIGESTS_BEFORE_THE_RENAME[1]
OLD = usage("call-1", **OLD_FIELDS)
BARE = usage("call-2")  # a record from before 0002: no caller's id


def row_before_0006(record: UsageRecord, digest: str) -> dict[str, Any]:
    """``record`` as a ledger before 0006 stored it: the call's id in request_id, the caller's in client_request_id."""
    row = _usage_row(record, 1, digest, 0)
    row["request_id"], row["client_request_id"] = row.pop("call_id"), row.pop("request_id")
    del row["request_kind"], row["door"], row["cached_prompt_tokens"]  # no such columns before 0007, 0008 and 0009
    del row["weight_dtype"]  # nor before 0010
    return row


def insert_before_0006(connection: Connection, row: dict[str, Any]) -> None:
    columns = [sa.column(name, JSON() if name == "labels" else None) for name in row]
    connection.execute(sa.insert(sa.table("usage_records", *columns)).values(**row))


@pytest.fixture(params=BACKENDS)
def at_0005(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A ledger at 0005 holding a tenant and two usage records, one with a caller's id, one without."""
    if request.param == "sqlite":
        yield from _filled(f"sqlite+pysqlite:///{tmp_path / 'ledger.db'}")
        return
    with fresh_postgres_schema() as url:
        yield from _filled(url)


def _filled(url: str) -> Iterator[str]:
    migrations.upgrade(url, "0005")
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(text("INSERT INTO tenants (name, created_at_us) VALUES ('acme', 0)"))
            insert_before_0006(connection, row_before_0006(OLD, OLD_DIGEST))
            insert_before_0006(connection, row_before_0006(BARE, BARE.payload_digest()))
    finally:
        engine.dispose()
    yield url


def rows(engine: Engine, sql: str) -> list[tuple]:
    with engine.connect() as connection:
        return [tuple(row) for row in connection.execute(text(sql))]


def assert_usage_guarded(engine: Engine, call_id_column: str) -> None:
    """usage_records is append-only, bounded, checked across columns, and unique per call."""
    for sql in ("UPDATE usage_records SET unit_us = 0", "DELETE FROM usage_records"):
        with pytest.raises(IntegrityError, match="append-only"), engine.begin() as connection:
            connection.execute(text(sql))
    # the columns named: at head the table has columns 0006 did not know (request_kind 0007, door 0008,
    # cached_prompt_tokens 0009, weight_dtype 0010: defaults)
    columns = (
        "id, {call_id}, tenant_id, labels, cost_center, team, model, device_kind, device_id, unit, num_units, unit_us, "
        "prompt_tokens, completion_tokens, received_at_us, dispatched_at_us, first_token_at_us, finished_at_us, "
        "deadline_at_us, deadline_met, outcome, payload_digest, ingested_at_us, {caller}, service_class"
    )
    copy = (
        f"INSERT INTO usage_records ({columns}) SELECT id + 10, {{id}}, tenant_id, labels, cost_center, team, model, "
        "device_kind, device_id, {unit}, num_units, {unit_us}, prompt_tokens, completion_tokens, received_at_us, "
        "dispatched_at_us, first_token_at_us, finished_at_us, deadline_at_us, deadline_met, outcome, "
        "payload_digest, ingested_at_us, {caller}, service_class FROM usage_records WHERE id = 1"
    )
    caller = "client_request_id" if call_id_column == "request_id" else "request_id"
    refusals = [
        (dict(id=call_id_column, unit="unit", unit_us="unit_us"), f"(?i)unique.*{call_id_column}"),
        (dict(id="'x'", unit="unit", unit_us="unit_us * 100000000"), "ck_usage_records_unit_us_range"),
        (dict(id="'x'", unit="'sm_us'", unit_us="unit_us"), "ck_usage_records_unit_of_device_kind"),
    ]
    for parts, refusal in refusals:
        with pytest.raises(IntegrityError, match=refusal), engine.begin() as connection:
            connection.execute(text(copy.format(call_id=call_id_column, caller=caller, **parts)))


def test_0006_renames_the_ids_of_a_ledger_with_usage_in_it_both_ways(at_0005: str) -> None:
    before = tables_and_routines(at_0005)
    engine = make_engine(at_0005)
    try:
        assert_usage_guarded(engine, "request_id")
        migrations.upgrade(at_0005, "0006")
        assert tables_and_routines(at_0005) == before  # every trigger (or trigger function) kept
        migrations.upgrade(at_0005)  # and on to head, whose models the code below writes with
        assert drift(at_0005) == []
        assert_usage_guarded(engine, "call_id")
        ids = "SELECT call_id, request_id FROM usage_records ORDER BY id"
        assert rows(engine, ids) == [("call-1", "caller-7"), ("call-2", "")]
        with unit_of_work(session_factory(engine)) as session:
            # stored before the rename, shipped again after it: the same call, not a conflict
            replay = ingest_usage(session, [OLD, BARE, usage("call-1", request_id="caller-8")])
            assert [r.status for r in replay] == [IngestStatus.DUPLICATE] * 2 + [IngestStatus.CONFLICT]
            # the caller's id is no key: a caller may send it again, billed as a call of its own
            assert ingest_usage(session, [usage("call-3", request_id="caller-7")])[0].status is IngestStatus.ACCEPTED
        migrations.downgrade(at_0005, "0005")
        assert tables_and_routines(at_0005) == before
        assert_usage_guarded(engine, "request_id")
        assert rows(engine, "SELECT request_id, client_request_id FROM usage_records ORDER BY id") == [
            ("call-1", "caller-7"),
            ("call-2", ""),
            ("call-3", "caller-7"),
        ]
        migrations.upgrade(at_0005)
        assert drift(at_0005) == []
        assert_usage_guarded(engine, "call_id")
        assert rows(engine, ids) == [("call-1", "caller-7"), ("call-2", ""), ("call-3", "caller-7")]
        with unit_of_work(session_factory(engine)) as session:
            assert [r.status for r in ingest_usage(session, [OLD])] == [IngestStatus.DUPLICATE]
    finally:
        engine.dispose()
