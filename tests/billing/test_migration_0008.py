"""Migration 0008 over a ledger with usage in it: usage_records.door (existing rows: grpc; the database refuses any
other value than grpc and http), both ways, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError

import migrations
from billing.db import ledger_errors, make_engine, session_factory, unit_of_work
from billing.errors import DataRejected
from billing.ledger import IngestStatus, _usage_row, ingest_usage
from billing.records import Door
from tests.billing.conftest import BACKENDS, fresh_postgres_schema
from tests.billing.factories import usage
from tests.billing.test_migration_0005 import _TENANT
from tests.billing.test_migration_0006 import insert_before_0006
from tests.billing.test_migrations import declared_checks, drift, revision, tables_and_routines

OLD = usage("call-old", request_kind="chat")  # stored before doors: it came through gRPC
_USAGE = text(
    "INSERT INTO usage_records (call_id, tenant_id, labels, model, device_kind, device_id, unit, num_units, unit_us, "
    "prompt_tokens, completion_tokens, received_at_us, dispatched_at_us, finished_at_us, deadline_at_us, "
    "deadline_met, outcome, payload_digest, ingested_at_us, door) VALUES (:call_id, 1, '{}', 'm', 'cpu', "
    "'cpu:h', 'core_us', 1, 1, 0, 0, 1, 1, 2, 3, true, 'ok', 'd', 0, :door)"
)


def test_the_models_declare_exactly_the_check_that_0008_installs() -> None:
    declared = declared_checks()
    installed = {name: expression for _, name, expression in revision("0008_doors.py").CHECKS}
    assert installed == {"ck_usage_records_door": "door IN ('grpc', 'http')"}
    assert {name: declared.get(name) for name in installed} == installed
    assert revision("0008_doors.py").DOORS == tuple(door.value for door in Door)


@pytest.fixture(params=BACKENDS)
def at_0007(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A ledger at 0007 holding a tenant and a usage record."""
    if request.param == "sqlite":
        yield from _filled(f"sqlite+pysqlite:///{tmp_path / 'ledger.db'}")
        return
    with fresh_postgres_schema() as url:
        yield from _filled(url)


def _filled(url: str) -> Iterator[str]:
    migrations.upgrade(url, "0007")
    engine = make_engine(url)
    row = _usage_row(OLD, 1, OLD.payload_digest(), 0)
    del row["door"], row["cached_prompt_tokens"], row["weight_dtype"]  # no such columns before 0008 (0009, 0010)
    try:
        with engine.begin() as connection:
            connection.execute(text(_TENANT))
            insert_before_0006(connection, row)  # any columns given: those of 0007 here
    finally:
        engine.dispose()
    yield url


def rows(engine: Engine, sql: str) -> list[tuple]:
    with engine.connect() as connection:
        return [tuple(row) for row in connection.execute(text(sql))]


def assert_doors_guarded(engine: Engine) -> None:
    """The database refuses a door it does not know, naming the field; it takes the two it knows."""
    for door in ("websocket", "", "HTTP", "grpc "):
        with pytest.raises(IntegrityError, match="ck_usage_records_door"), engine.begin() as connection:
            connection.execute(_USAGE, {"call_id": f"bad-{door}", "door": door})
    with pytest.raises(DataRejected) as caught, ledger_errors(), engine.begin() as connection:
        connection.execute(_USAGE, {"call_id": "bad", "door": "websocket"})
    assert caught.value.field == "door"
    with engine.connect() as connection:  # the statement is sound: with a door the CHECK knows it goes in
        for door in Door:
            connection.execute(_USAGE, {"call_id": f"good-{door.value}", "door": door.value})
        connection.rollback()  # leaves the ledger as it was


def test_0008_makes_old_rows_grpc_and_guards_doors_both_ways(at_0007: str) -> None:
    before = tables_and_routines(at_0007)
    engine = make_engine(at_0007)
    try:
        migrations.upgrade(at_0007)
        assert drift(at_0007) == []
        assert rows(engine, "SELECT call_id, request_kind, door FROM usage_records") == [("call-old", "chat", "grpc")]
        assert_doors_guarded(engine)
        with unit_of_work(session_factory(engine)) as session:  # stored before doors: still the same record
            replays = ingest_usage(session, [OLD, usage("call-old", request_kind="chat", door="http")])
        assert [r.status for r in replays] == [IngestStatus.DUPLICATE, IngestStatus.CONFLICT]

        migrations.downgrade(at_0007, "0007")  # every record is grpc: nothing is lost
        assert tables_and_routines(at_0007) == before
        assert rows(engine, "SELECT call_id, request_kind FROM usage_records") == [("call-old", "chat")]

        migrations.upgrade(at_0007)
        assert drift(at_0007) == []
        assert_doors_guarded(engine)
        with unit_of_work(session_factory(engine)) as session:
            ingest_usage(session, [usage("call-http", door=Door.HTTP)])
        with pytest.raises(RuntimeError, match="1 usage record.*door other than grpc"):
            migrations.downgrade(at_0007, "0007")
        assert rows(engine, "SELECT door FROM usage_records ORDER BY id") == [("grpc",), ("http",)]
        assert drift(at_0007) == []  # still at 0008: the refusal changed nothing
    finally:
        engine.dispose()
