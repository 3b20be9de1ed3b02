"""The weight dtype on usage (issue 34): a record from a replica serving int8 weights keeps "int8" in the ledger, a
record from a sender before weight dtypes is stored as unknown (''), another dtype under a stored call_id is a
conflict, and chargeback groups by it without pricing it; on SQLite and on PostgreSQL."""

from __future__ import annotations

import dataclasses

from sqlalchemy import select

from billing.chargeback import chargeback_report
from billing.db import unit_of_work
from billing.ledger import IngestStatus, ingest_usage, query_usage
from billing.models import UsageConflict, UsageRow
from billing.pricing import add_price
from billing.records import UsageRecord
from billing.tenants import create_tenant
from tests.billing.conftest import Ledger
from tests.billing.factories import PERIOD, START_US, US_PER_HOUR, missed, usage


def before_weight_dtypes(record: UsageRecord) -> UsageRecord:
    """``record`` as an outbox row written by a replica before weight dtypes decodes: its payload has no such key."""
    payload = record.to_v1_payload()
    del payload["weight_dtype"]
    return UsageRecord.from_v1_payload(payload)


def test_an_int8_record_keeps_its_dtype_and_an_older_senders_record_is_stored_as_unknown(ledger: Ledger) -> None:
    int8, bf16 = usage("r-int8", weight_dtype="int8"), usage("r-bf16", weight_dtype="bfloat16")
    old = before_weight_dtypes(usage("r-old", door="http"))
    assert old.weight_dtype == ""
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
        assert [r.status for r in ingest_usage(session, [int8, bf16, old])] == [IngestStatus.ACCEPTED] * 3
    with unit_of_work(ledger.sessions) as session:
        replays = ingest_usage(
            session,
            [
                int8,
                dataclasses.replace(int8, weight_dtype="bfloat16"),  # the same call, now claiming other weights
                before_weight_dtypes(old),  # a sender before weight dtypes again: the same record
                dataclasses.replace(old, weight_dtype="int8"),
            ],
        )
    assert [r.status for r in replays] == [
        IngestStatus.DUPLICATE,
        IngestStatus.CONFLICT,
        IngestStatus.DUPLICATE,
        IngestStatus.CONFLICT,
    ]
    with ledger.sessions() as session:
        stored = dict(session.execute(select(UsageRow.call_id, UsageRow.weight_dtype)).all())
        rejected = {c.record_id: c.rejected_payload["weight_dtype"] for c in session.scalars(select(UsageConflict))}
        page = query_usage(session, start_us=START_US, end_us=START_US + 2 * US_PER_HOUR)
    assert stored == {"r-int8": "int8", "r-bf16": "bfloat16", "r-old": ""}  # never overwritten
    assert rejected == {"r-int8": "bfloat16", "r-old": "int8"}
    assert sorted(page.records, key=lambda r: r.call_id) == [bf16, int8, old]


def test_chargeback_groups_by_weight_dtype_and_prices_every_dtype_of_a_model_alike(ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
        add_price(session, "tiny", "core_us", 1_000, "USD", 0)  # per core·s, whatever the weights
        ingest_usage(
            session,
            [
                usage("q1", unit_us=2_000_000, weight_dtype="int8"),
                missed("q2", unit_us=3_000_000, weight_dtype="int8"),  # credited in full: standard
                usage("b1", unit_us=4_000_000, weight_dtype="bfloat16"),
                usage("u1", unit_us=1_000_000),  # before weight dtypes: unknown
            ],
        )
    with ledger.sessions() as session:
        by_dtype = chargeback_report(session, PERIOD, ["model", "weight_dtype"])
        by_model = chargeback_report(session, PERIOD, ["model"])
    assert [(dict(r.group), r.num_requests, r.num_deadline_met, r.unit_us, r.cost_micros) for r in by_dtype.rows] == [
        ({"model": "tiny", "weight_dtype": "(none)"}, 1, 1, 1_000_000, 1_000),
        ({"model": "tiny", "weight_dtype": "bfloat16"}, 1, 1, 4_000_000, 4_000),
        ({"model": "tiny", "weight_dtype": "int8"}, 2, 1, 5_000_000, 2_000),  # q2's 3,000 credited
    ]
    (row,) = by_model.rows
    assert (row.num_requests, row.unit_us, row.cost_micros) == (4, 10_000_000, 7_000)  # the same money, unsplit
