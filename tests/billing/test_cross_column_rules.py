"""Migration 0004: the rules that cross columns (unit and device_id by device kind; deadline_met by the times and
the outcome) hold whoever writes, on SQLite and PostgreSQL, and read as INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest
from sqlalchemy import CheckConstraint, TextClause, func, select, text
from sqlalchemy.exc import IntegrityError

import migrations
from billing.db import CONSTRAINT_FIELDS, ledger_errors, make_engine, unit_of_work
from billing.errors import DataRejected, InvalidArgument
from billing.ledger import ingest_idle, ingest_usage
from billing.models import Base, IdleRow, UsageRow
from billing.records import Outcome
from billing.tenants import create_tenant
from tests.billing.conftest import Ledger
from tests.billing.factories import gpu_usage, idle, missed, usage
from tests.billing.test_migrations import drift, empty_url, tables_and_routines  # noqa: F401 - empty_url is a fixture


def revision_0004() -> Any:
    spec = importlib.util.spec_from_file_location(
        "revision_0004", migrations.MIGRATIONS_DIR / "versions" / "0004_cross_column_rules.py"
    )
    revision = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(revision)
    return revision


RULES = {name: expression.format(r="") for _, name, expression in revision_0004().CHECKS}

# A valid CPU row: finished at 2, deadline 3, met, ok. Each case changes it so that exactly one rule breaks.
_USAGE_ROW = dict(
    device_kind="cpu",
    device_id="cpu:h",
    unit="core_us",
    finished_at_us=2,
    deadline_at_us=3,
    deadline_met=True,
    outcome="ok",
)
_USAGE_SQL = (
    "INSERT INTO usage_records ({id_column}, tenant_id, labels, model, device_kind, device_id, unit, num_units, "
    "unit_us, prompt_tokens, completion_tokens, received_at_us, dispatched_at_us, finished_at_us, deadline_at_us, "
    "deadline_met, outcome, payload_digest, ingested_at_us) VALUES (:call_id, 1, '{{}}', 'm', :device_kind, "
    ":device_id, :unit, 1, 1, 0, 0, 1, 1, :finished_at_us, :deadline_at_us, :deadline_met, :outcome, 'd', 0)"
)
_USAGE = text(_USAGE_SQL.format(id_column="call_id"))
_USAGE_BEFORE_0006 = text(_USAGE_SQL.format(id_column="request_id"))  # the call's id, until 0006 renamed it
_IDLE = text(
    "INSERT INTO idle_records (record_id, device_id, unit, num_units, minute_start_us, idle_unit_us, wall_unit_us, "
    "payload_digest, ingested_at_us) VALUES (:record_id, :device_id, :unit, 1, 0, 0, 1, 'd', 0)"
)
BROKEN_USAGE = [
    ({"device_kind": "cuda", "device_id": "GPU-1"}, "ck_usage_records_unit_of_device_kind"),  # core_us on a GPU
    ({"unit": "sm_us"}, "ck_usage_records_unit_of_device_kind"),  # SMs on a CPU
    ({"device_id": "GPU-1"}, "ck_usage_records_device_id_of_kind"),
    ({"device_kind": "cuda", "unit": "sm_us"}, "ck_usage_records_device_id_of_kind"),  # cpu:h is no GPU
    ({"device_kind": "cuda", "unit": "sm_us", "device_id": "gpu-1"}, "ck_usage_records_device_id_of_kind"),
    ({"finished_at_us": 4, "outcome": "cancelled"}, "ck_usage_records_deadline_met_on_time"),
    ({"finished_at_us": 4, "outcome": "error"}, "ck_usage_records_deadline_met_on_time"),
    ({"outcome": "deadline_exceeded"}, "ck_usage_records_deadline_exceeded_not_met"),
    ({"deadline_met": False}, "ck_usage_records_ok_deadline_met_is_on_time"),  # ok, on time, yet not met
]
# Rows Python accepts: the database must too (no rule stricter than billing/records.py).
VALID_USAGE = [
    {},
    {"device_kind": "cuda", "device_id": "GPU-1", "unit": "sm_us"},
    {"device_kind": "cuda", "device_id": "MIG-1", "unit": "sm_us"},
    {"finished_at_us": 4, "deadline_met": False},  # ok and late: missed
    {"finished_at_us": 3},  # ok and finished at the deadline: met
    {"deadline_met": False, "outcome": "cancelled"},  # a cancelled call may miss a deadline it finished before
    {"deadline_met": False, "outcome": "error"},
    {"outcome": "error"},
    {"finished_at_us": 4, "deadline_met": False, "outcome": "error"},
    {"deadline_met": False, "outcome": "deadline_exceeded"},
    {"finished_at_us": 4, "deadline_met": False, "outcome": "deadline_exceeded"},
]
BROKEN_IDLE = [
    ({"unit": "sm_us", "device_id": "cpu:h"}, "ck_idle_records_device_id_of_unit"),
    ({"unit": "core_us", "device_id": "GPU-1"}, "ck_idle_records_device_id_of_unit"),
    ({"unit": "core_us", "device_id": "MIG-1"}, "ck_idle_records_device_id_of_unit"),
]
VALID_IDLE = [{"unit": "core_us", "device_id": "cpu:h"}, {"unit": "sm_us", "device_id": "GPU-1"}]


def usage_row(call_id: str, change: dict[str, object]) -> dict[str, object]:
    return {"call_id": call_id, **_USAGE_ROW, **change}


def idle_row(record_id: str, change: dict[str, object]) -> dict[str, object]:
    return {"record_id": record_id, **change}


@pytest.fixture
def acme(ledger: Ledger) -> Ledger:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
    return ledger


def count(ledger: Ledger, table: type[UsageRow] | type[IdleRow]) -> int:
    with ledger.sessions() as session:
        return session.scalar(select(func.count()).select_from(table))


# --- the database refuses each broken rule itself, with Python's checks bypassed --------------------------------


@pytest.mark.parametrize(("change", "constraint"), BROKEN_USAGE + [(row, None) for row in VALID_USAGE])
def test_raw_usage_inserts_meet_the_rules(acme: Ledger, change: dict, constraint: str | None) -> None:
    if constraint is None:
        with acme.engine.begin() as connection:
            connection.execute(_USAGE, usage_row("r", change))
        assert count(acme, UsageRow) == 1
        return
    with pytest.raises(IntegrityError, match=constraint), acme.engine.begin() as connection:
        connection.execute(_USAGE, usage_row("r", change))
    with pytest.raises(DataRejected) as caught, ledger_errors(), acme.engine.begin() as connection:
        connection.execute(_USAGE, usage_row("r", change))
    assert caught.value.field == CONSTRAINT_FIELDS[constraint] and constraint in caught.value.message
    assert count(acme, UsageRow) == 0


@pytest.mark.parametrize(("change", "constraint"), BROKEN_IDLE + [(row, None) for row in VALID_IDLE])
def test_raw_idle_inserts_meet_the_rules(ledger: Ledger, change: dict, constraint: str | None) -> None:
    if constraint is None:
        with ledger.engine.begin() as connection:
            connection.execute(_IDLE, idle_row("i", change))
        assert count(ledger, IdleRow) == 1
        return
    with pytest.raises(DataRejected) as caught, ledger_errors(), ledger.engine.begin() as connection:
        connection.execute(_IDLE, idle_row("i", change))
    assert caught.value.field == "device_id" and constraint in caught.value.message
    assert count(ledger, IdleRow) == 0


# --- through the ledger: a record that slipped past Python is refused precisely; valid ones still ingest ----------


def forged(record: Any, **changes: object) -> Any:
    """``record`` with fields changed after its validation ran: what a bug in Python's checks would let through."""
    for name, value in changes.items():
        object.__setattr__(record, name, value)
    return record


@pytest.mark.parametrize(
    ("record", "field"),
    [
        (lambda: forged(usage("bad"), unit="sm_us"), "unit"),
        (lambda: forged(gpu_usage("bad"), device_id="cpu:h"), "device_id"),
        (lambda: forged(usage("bad"), deadline_met=False), "deadline_met"),
        (lambda: forged(missed("bad"), outcome=Outcome.ERROR, deadline_met=True), "deadline_met"),
        (lambda: forged(missed("bad", deadline_at_us=10**17), deadline_met=True), "deadline_met"),
    ],
)
def test_the_ledger_refuses_a_forged_record_as_invalid_argument(acme: Ledger, record, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught, ledger_errors(), unit_of_work(acme.sessions) as session:
        ingest_usage(session, [usage("good"), record()])
    assert isinstance(caught.value, DataRejected) and caught.value.field == field
    assert count(acme, UsageRow) == 0  # the whole transaction: nothing was stored
    with ledger_errors(), unit_of_work(acme.sessions) as session:
        results = ingest_usage(
            session, [usage("good"), gpu_usage("gpu"), missed("late"), usage("mig", outcome="error")]
        )
        results += ingest_usage(
            session, [gpu_usage("mig-1", device_id="MIG-1", deadline_met=False, outcome="cancelled")]
        )
    assert [result.status.value for result in results] == ["accepted"] * 5
    with pytest.raises(DataRejected) as caught, ledger_errors(), unit_of_work(acme.sessions) as session:
        ingest_idle(session, [forged(idle("cpu:h", 0, 1), unit="sm_us")])
    assert caught.value.field == "device_id"


# --- the revision: upgrade, downgrade, and no upgrade over rows that break it -----------------------------------


def installed(url: str) -> set[str]:
    """The 0004 rules the database holds: CHECK constraints (PostgreSQL) or their triggers (SQLite)."""
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            if engine.dialect.name == "postgresql":
                names = connection.execute(
                    text(
                        "SELECT conname FROM pg_constraint JOIN pg_namespace n ON n.oid = connamespace "
                        "WHERE contype = 'c' AND n.nspname = current_schema()"
                    )
                ).scalars()
            else:
                triggers = connection.execute(text("SELECT name FROM sqlite_master WHERE type = 'trigger'")).scalars()
                names = (name.removeprefix("trg_").removesuffix("_insert") for name in triggers)
            return set(names) & set(RULES)
    finally:
        engine.dispose()


def insert(url: str, statement: TextClause, row: dict[str, object]) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(statement, row)
    finally:
        engine.dispose()


def test_0004_upgrades_and_downgrades(empty_url: str) -> None:
    migrations.upgrade(empty_url, "0004")
    assert installed(empty_url) == set(RULES)
    at_0004 = tables_and_routines(empty_url)
    migrations.downgrade(empty_url, "0003")
    assert installed(empty_url) == set()
    tables, routines = tables_and_routines(empty_url)
    assert tables == at_0004[0] and routines <= at_0004[1]  # 0001's and 0003's guards stay
    migrations.upgrade(empty_url, "0004")
    assert installed(empty_url) == set(RULES)
    assert tables_and_routines(empty_url) == at_0004
    migrations.upgrade(empty_url)
    assert installed(empty_url) == set(RULES)  # 0005 copies prices, 0006 usage_records; 0004's rules stay
    assert drift(empty_url) == []
    insert(empty_url, text("INSERT INTO tenants (name, created_at_us) VALUES ('acme', 0)"), {})
    for index, (change, constraint) in enumerate(BROKEN_USAGE):
        with pytest.raises(IntegrityError, match=constraint):
            insert(empty_url, _USAGE, usage_row(f"r-{index}", change))


@pytest.mark.parametrize(
    ("statement", "row", "constraint"),
    [
        (_USAGE_BEFORE_0006, usage_row("r", {"deadline_met": False}), "ck_usage_records_ok_deadline_met_is_on_time"),
        (_USAGE_BEFORE_0006, usage_row("r", {"unit": "sm_us"}), "ck_usage_records_unit_of_device_kind"),
        (_IDLE, idle_row("i", {"unit": "sm_us", "device_id": "cpu:h"}), "ck_idle_records_device_id_of_unit"),
    ],
)
def test_0004_will_not_upgrade_over_rows_that_break_its_rules(
    empty_url: str, statement: TextClause, row: dict, constraint: str
) -> None:
    migrations.upgrade(empty_url, "0003")
    insert(empty_url, text("INSERT INTO tenants (name, created_at_us) VALUES ('acme', 0)"), {})
    insert(empty_url, statement, row)  # before 0004 the database lets it in
    with pytest.raises(RuntimeError, match=f"revision 0004: 1 row.*{constraint}"):
        migrations.upgrade(empty_url)
    assert installed(empty_url) == set()  # stopped before installing any rule


def test_the_models_declare_exactly_the_checks_that_0004_installs() -> None:
    declared = {
        str(constraint.name): str(constraint.sqltext)
        for table in Base.metadata.tables.values()
        for constraint in table.constraints
        if isinstance(constraint, CheckConstraint)
    }
    assert {name: declared.get(name) for name in RULES} == RULES
    assert set(RULES) <= set(CONSTRAINT_FIELDS)  # each refusal names its field


def test_every_rule_is_one_that_python_enforces() -> None:
    """Each broken raw row is also refused by billing/records.py, naming the field the database names."""
    records = {
        "ck_usage_records_unit_of_device_kind": [lambda: usage("r", unit="sm_us")],
        "ck_usage_records_device_id_of_kind": [lambda: usage("r", device_id="GPU-1")],
        "ck_usage_records_deadline_met_on_time": [lambda: usage("r", outcome="error", deadline_at_us=1)],
        "ck_usage_records_deadline_exceeded_not_met": [lambda: usage("r", outcome="deadline_exceeded")],
        "ck_usage_records_ok_deadline_met_is_on_time": [lambda: usage("r", deadline_met=False)],
        "ck_idle_records_device_id_of_unit": [lambda: dataclasses.replace(idle("cpu:h", 0, 1), unit="sm_us")],
    }
    assert set(records) == set(RULES)
    for constraint, makers in records.items():
        for make in makers:
            with pytest.raises(InvalidArgument) as caught:
                make()
            assert caught.value.field == CONSTRAINT_FIELDS[constraint], constraint
