"""What the database itself refuses: edits of append-only rows, broken uniqueness and constraints."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from billing.db import unit_of_work
from billing.ledger import ingest_idle, ingest_usage
from billing.pricing import add_price
from billing.tenants import create_tenant
from tests.billing.conftest import Ledger
from tests.billing.factories import idle, usage


@pytest.fixture
def stocked(ledger: Ledger) -> Ledger:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
        ingest_usage(session, [usage("r-1"), usage("r-2")])
        ingest_usage(session, [usage("r-1", unit_us=5)])  # leaves a conflict row
        ingest_idle(session, [idle("cpu:host-a", 0, 10)])
        add_price(session, "tiny", "core_us", 100, "USD", 0)
    return ledger


def refused(ledger: Ledger, sql: str) -> str:
    with pytest.raises(IntegrityError) as caught, unit_of_work(ledger.sessions) as session:
        session.execute(text(sql))
    return str(caught.value.orig)


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE usage_records SET unit_us = 0",
        "UPDATE usage_records SET tenant_id = tenant_id",
        "DELETE FROM usage_records WHERE call_id = 'r-2'",
        "UPDATE idle_records SET idle_unit_us = 0",
        "DELETE FROM idle_records",
        "UPDATE usage_conflicts SET rejected_digest = stored_digest",
        "DELETE FROM usage_conflicts",
        "UPDATE prices SET price_micros = 1",
        "DELETE FROM prices",
    ],
)
def test_append_only_tables_refuse_update_and_delete(stocked: Ledger, sql: str) -> None:
    assert "append-only" in refused(stocked, sql)
    with stocked.sessions() as session:
        assert session.execute(text("SELECT count(*) FROM usage_records")).scalar() == 2
        assert session.execute(text("SELECT sum(unit_us) FROM usage_records")).scalar() == 2_000_000


COLUMNS = (
    "call_id, tenant_id, labels, model, device_kind, device_id, unit, num_units, unit_us, prompt_tokens, "
    "completion_tokens, received_at_us, dispatched_at_us, finished_at_us, deadline_at_us, deadline_met, "
    "outcome, payload_digest, ingested_at_us"
)


def raw_usage(call_id: str = "r-raw", tenant_id: str = "1", unit: str = "core_us", unit_us: str = "1") -> str:
    return (
        f"INSERT INTO usage_records ({COLUMNS}) VALUES ('{call_id}', {tenant_id}, '{{}}', 'tiny', 'cpu', "
        f"'cpu:h', '{unit}', 1, {unit_us}, 0, 0, 1, 1, 2, 3, true, 'ok', 'digest', 1)"
    )


@pytest.mark.parametrize(
    ("sql", "why"),
    [
        (raw_usage("r-1"), "unique"),
        (raw_usage(tenant_id="999"), "foreign key"),
        (raw_usage(unit="gpu_s"), "check"),
        (raw_usage(unit_us="-1"), "check"),
    ],
)
def test_uniqueness_foreign_keys_and_checks_are_the_databases(stocked: Ledger, sql: str, why: str) -> None:
    assert why in refused(stocked, sql).lower()
