"""The door a call came through (gRPC or HTTP) on the metering wire: it travels, it is kept, it is part of the record
(another door under a stored call_id is a conflict), and chargeback groups by it; on SQLite and on PostgreSQL."""

from __future__ import annotations

import pytest
from zeroqueue.metering.v1 import metering_pb2 as pb

from billing.records import Door
from services.metering.servicer import usage_from_pb, usage_to_pb
from tests.billing.conftest import Ledger
from tests.billing.factories import missed, usage
from tests.metering.conftest import Keys, bearer
from tests.metering.test_servicer import PAST, PAST_START_US, record, send, stored_rows


@pytest.mark.parametrize("door", list(Door))
def test_the_door_survives_the_wire_and_a_sender_before_doors_sends_grpc(door: Door) -> None:
    message = record("r1", door=door, request_kind="chat")
    assert message.door == door.value
    decoded = usage_from_pb(pb.UsageRecord.FromString(message.SerializeToString()))
    assert decoded == usage("r1", door=door, request_kind="chat") and decoded.door is door
    message.ClearField("door")  # as a replica before doors sends it
    assert usage_from_pb(message) == usage("r1", request_kind="chat", door=Door.GRPC)


def test_the_ledger_keeps_the_door_refuses_an_unknown_one_and_another_door_is_a_conflict(
    stub, keys: Keys, ledger: Ledger
) -> None:
    websocket = record("d-websocket")
    websocket.door = "websocket"
    response = send(stub, keys.admin, record("d-http", door="http"), record("d-grpc"), websocket)
    assert [pb.RecordStatus.Name(r.status) for r in response.records] == [
        "RECORD_STATUS_ACCEPTED",
        "RECORD_STATUS_ACCEPTED",
        "RECORD_STATUS_INVALID",
    ]
    assert response.records[2].message.startswith("door ") and "websocket" in response.records[2].message
    stored = stub.QueryUsage(pb.QueryUsageRequest(), metadata=bearer(keys.admin)).records
    assert {r.call_id: r.door for r in stored} == {"d-http": "http", "d-grpc": "grpc"}
    replays = send(stub, keys.admin, record("d-http", door="http"), record("d-http"), record("d-grpc", door="http"))
    assert [pb.RecordStatus.Name(r.status) for r in replays.records] == [
        "RECORD_STATUS_DUPLICATE",
        "RECORD_STATUS_CONFLICT",  # the same call, now claiming gRPC
        "RECORD_STATUS_CONFLICT",  # and the other, now claiming HTTP
    ]
    assert stored_rows(ledger) == 2


def test_chargeback_by_door_over_the_wire(stub, keys: Keys) -> None:
    send(
        stub,
        keys.admin,
        record("a1", finished_at_us=PAST_START_US + 10, door="http"),
        record("a2", finished_at_us=PAST_START_US + 20, unit_us=2_000_000),
        record("a3", finished_at_us=PAST_START_US + 25, unit_us=3_000_000, door="http"),
        usage_to_pb(missed("a4", finished_at_us=PAST_START_US + 30, door="http")),
        record("g1", tenant="globex", finished_at_us=PAST_START_US + 40, door="http"),
    )
    by_door = stub.GetChargebackReport(
        pb.GetChargebackReportRequest(period=PAST, group_by=["door"]), metadata=bearer(keys.admin)
    )
    assert list(by_door.group_by) == ["door"]
    assert [(dict(r.group), r.requests, r.deadline_met, r.unit_us, r.cost_micros) for r in by_door.rows] == [
        ({"door": "grpc"}, 1, 1, 2_000_000, 3_000),  # 1,500 micros per core·s
        ({"door": "http"}, 4, 3, 6_000_000, 7_500),  # a4's miss credited: 1,500 − 1,500
    ]
    own = stub.GetChargebackReport(
        pb.GetChargebackReportRequest(period=PAST, group_by=["tenant", "door"]), metadata=bearer(keys.globex)
    )
    assert [(dict(r.group), r.requests, r.cost_micros) for r in own.rows] == [
        ({"tenant": "globex", "door": "http"}, 1, 1_500)
    ]
