"""Migration 0010 over a ledger with usage in it: usage_records.weight_dtype (existing rows: '', unknown; a record
from a quantized replica keeps its 'int8'), both ways, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, inspect, text

import migrations
from billing.db import make_engine, session_factory, unit_of_work
from billing.ledger import IngestStatus, _usage_row, ingest_usage, query_usage
from billing.period import US_PER_DAY
from tests.billing.conftest import BACKENDS, fresh_postgres_schema
from tests.billing.factories import START_US, usage
from tests.billing.test_migration_0005 import _TENANT
from tests.billing.test_migration_0006 import insert_before_0006
from tests.billing.test_migrations import drift, tables_and_routines

OLD = usage("call-old", door="http", cached_prompt_tokens=3)  # stored before weight dtypes: nobody said


@pytest.fixture(params=BACKENDS)
def at_0009(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A ledger at 0009 holding a tenant and a usage record."""
    if request.param == "sqlite":
        yield from _filled(f"sqlite+pysqlite:///{tmp_path / 'ledger.db'}")
        return
    with fresh_postgres_schema() as url:
        yield from _filled(url)


def _filled(url: str) -> Iterator[str]:
    migrations.upgrade(url, "0009")
    engine = make_engine(url)
    row = _usage_row(OLD, 1, OLD.payload_digest(), 0)
    del row["weight_dtype"]  # no such column before 0010
    try:
        with engine.begin() as connection:
            connection.execute(text(_TENANT))
            insert_before_0006(connection, row)  # any columns given: those of 0009 here
    finally:
        engine.dispose()
    yield url


def rows(engine: Engine, sql: str) -> list[tuple]:
    with engine.connect() as connection:
        return [tuple(row) for row in connection.execute(text(sql))]


def has_weight_dtype(engine: Engine) -> bool:
    return "weight_dtype" in {column["name"] for column in inspect(engine).get_columns("usage_records")}


def test_0010_makes_old_rows_unknown_keeps_int8_and_goes_back_only_without_a_dtype(at_0009: str) -> None:
    before = tables_and_routines(at_0009)
    engine = make_engine(at_0009)
    try:
        migrations.upgrade(at_0009)
        assert drift(at_0009) == []
        assert rows(engine, "SELECT call_id, door, cached_prompt_tokens, weight_dtype FROM usage_records") == [
            ("call-old", "http", 3, "")
        ]
        with session_factory(engine)() as session:  # read back, the old row is the record it was stored from
            assert query_usage(session, start_us=START_US, end_us=START_US + US_PER_DAY).records == [OLD]
        with unit_of_work(session_factory(engine)) as session:  # stored before weight dtypes: still the same record
            replays = ingest_usage(
                session, [OLD, usage("call-old", door="http", cached_prompt_tokens=3, weight_dtype="int8")]
            )
        assert [r.status for r in replays] == [IngestStatus.DUPLICATE, IngestStatus.CONFLICT]

        migrations.downgrade(at_0009, "0009")  # no record names a dtype: nothing is lost
        assert tables_and_routines(at_0009) == before
        assert not has_weight_dtype(engine)
        assert rows(engine, "SELECT call_id, door, cached_prompt_tokens FROM usage_records") == [
            ("call-old", "http", 3)
        ]

        migrations.upgrade(at_0009)
        assert drift(at_0009) == []
        with unit_of_work(session_factory(engine)) as session:
            ingest_usage(
                session, [usage("call-int8", weight_dtype="int8"), usage("call-bf16", weight_dtype="bfloat16")]
            )
        with pytest.raises(RuntimeError, match="2 usage record.*name a weight dtype"):
            migrations.downgrade(at_0009, "0009")
        assert rows(engine, "SELECT call_id, weight_dtype FROM usage_records ORDER BY call_id") == [
            ("call-bf16", "bfloat16"),
            ("call-int8", "int8"),
            ("call-old", ""),
        ]
        assert has_weight_dtype(engine)
        assert drift(at_0009) == []  # still at 0010: the refusal changed nothing
    finally:
        engine.dispose()
