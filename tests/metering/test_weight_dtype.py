"""The weight dtype on the metering wire (issue 34): it travels, a sender before it (field 24 unset) is unknown and
still accepted, a malformed one is refused naming the field, it is part of the record (another dtype under a stored
call_id is a conflict), and chargeback groups by it; on SQLite and on PostgreSQL."""

from __future__ import annotations

import pytest
from zeroqueue.metering.v1 import metering_pb2 as pb

from services.metering.servicer import usage_from_pb
from tests.billing.conftest import Ledger
from tests.billing.factories import usage
from tests.metering.conftest import Keys, bearer
from tests.metering.test_servicer import PAST, PAST_START_US, record, send, stored_rows


@pytest.mark.parametrize("dtype", ["int8", "bfloat16", "float32"])
def test_the_dtype_survives_the_wire_and_a_sender_before_it_is_unknown(dtype: str) -> None:
    message = record("r1", weight_dtype=dtype, door="http")
    assert message.weight_dtype == dtype
    decoded = usage_from_pb(pb.UsageRecord.FromString(message.SerializeToString()))
    assert decoded == usage("r1", weight_dtype=dtype, door="http")
    message.ClearField("weight_dtype")  # as a replica before weight dtypes sends it
    assert usage_from_pb(message) == usage("r1", door="http", weight_dtype="")


def test_the_ledger_keeps_int8_takes_an_older_senders_record_and_another_dtype_is_a_conflict(
    stub, keys: Keys, ledger: Ledger
) -> None:
    old, bad = record("w-old"), record("w-bad", weight_dtype="int8")
    old.ClearField("weight_dtype")  # a metering client before weight dtypes
    bad.weight_dtype = "INT8"
    response = send(stub, keys.admin, record("w-int8", weight_dtype="int8"), old, bad)
    assert [pb.RecordStatus.Name(r.status) for r in response.records] == [
        "RECORD_STATUS_ACCEPTED",
        "RECORD_STATUS_ACCEPTED",
        "RECORD_STATUS_INVALID",
    ]
    assert response.records[2].message.startswith("weight_dtype ") and "'INT8'" in response.records[2].message
    stored = stub.QueryUsage(pb.QueryUsageRequest(), metadata=bearer(keys.admin)).records
    assert {r.call_id: r.weight_dtype for r in stored} == {"w-int8": "int8", "w-old": ""}
    replays = send(
        stub,
        keys.admin,
        record("w-int8", weight_dtype="int8"),
        old,
        record("w-int8", weight_dtype="bfloat16"),
        record("w-old", weight_dtype="int8"),
    )
    assert [pb.RecordStatus.Name(r.status) for r in replays.records] == [
        "RECORD_STATUS_DUPLICATE",
        "RECORD_STATUS_DUPLICATE",
        "RECORD_STATUS_CONFLICT",  # the same call, now claiming other weights
        "RECORD_STATUS_CONFLICT",  # and the unknown one, now claiming int8
    ]
    assert stored_rows(ledger) == 2


def test_chargeback_by_weight_dtype_over_the_wire(stub, keys: Keys) -> None:
    send(
        stub,
        keys.admin,
        record("a1", finished_at_us=PAST_START_US + 10, weight_dtype="int8"),
        record("a2", finished_at_us=PAST_START_US + 20, unit_us=2_000_000, weight_dtype="bfloat16"),
        record("a3", finished_at_us=PAST_START_US + 30, unit_us=3_000_000, weight_dtype="int8"),
        record("a4", finished_at_us=PAST_START_US + 40),
    )
    report = stub.GetChargebackReport(
        pb.GetChargebackReportRequest(period=PAST, group_by=["model", "weight_dtype"]), metadata=bearer(keys.admin)
    )
    assert [(dict(r.group), r.requests, r.unit_us, r.cost_micros) for r in report.rows] == [
        ({"model": "tiny", "weight_dtype": "(none)"}, 1, 1_000_000, 1_500),  # 1,500 micros per core·s, any dtype
        ({"model": "tiny", "weight_dtype": "bfloat16"}, 1, 2_000_000, 3_000),
        ({"model": "tiny", "weight_dtype": "int8"}, 2, 4_000_000, 6_000),
    ]
