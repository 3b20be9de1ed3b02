"""The prompt tokens the prefix cache served on the metering wire (issue 33): the count travels, it is validated and
kept, it is part of the record (another count under a stored call_id is a conflict), and chargeback shows it; on
SQLite and on PostgreSQL."""

from __future__ import annotations

import pytest
from zeroqueue.metering.v1 import metering_pb2 as pb

from services.metering.servicer import usage_from_pb, usage_to_pb
from tests.billing.conftest import Ledger
from tests.billing.factories import missed, usage
from tests.metering.conftest import Keys, bearer
from tests.metering.test_servicer import PAST, PAST_START_US, record, send, stored_rows


@pytest.mark.parametrize("cached", [0, 7, 10])
def test_the_count_survives_the_wire_and_a_sender_before_the_cache_sends_0(cached: int) -> None:
    message = record("r1", cached_prompt_tokens=cached, door="http")
    assert message.cached_prompt_tokens == cached
    decoded = usage_from_pb(pb.UsageRecord.FromString(message.SerializeToString()))
    assert decoded == usage("r1", cached_prompt_tokens=cached, door="http")
    message.ClearField("cached_prompt_tokens")  # as a replica before the cache sends it
    assert usage_from_pb(message) == usage("r1", door="http", cached_prompt_tokens=0)


def test_the_ledger_keeps_the_count_refuses_one_outside_the_prompt_and_another_count_is_a_conflict(
    stub, keys: Keys, ledger: Ledger
) -> None:
    too_many, negative = record("c-too-many"), record("c-negative")
    too_many.cached_prompt_tokens = 11  # its prompt is 10 tokens
    negative.cached_prompt_tokens = -1
    response = send(stub, keys.admin, record("c-hit", cached_prompt_tokens=8), record("c-miss"), too_many, negative)
    assert [pb.RecordStatus.Name(r.status) for r in response.records] == [
        "RECORD_STATUS_ACCEPTED",
        "RECORD_STATUS_ACCEPTED",
        "RECORD_STATUS_INVALID",
        "RECORD_STATUS_INVALID",
    ]
    assert response.records[2].message.startswith("cached_prompt_tokens ") and "got 11" in response.records[2].message
    assert response.records[3].message.startswith("cached_prompt_tokens ") and "got -1" in response.records[3].message
    stored = stub.QueryUsage(pb.QueryUsageRequest(), metadata=bearer(keys.admin)).records
    assert {r.call_id: r.cached_prompt_tokens for r in stored} == {"c-hit": 8, "c-miss": 0}
    replays = send(
        stub,
        keys.admin,
        record("c-hit", cached_prompt_tokens=8),
        record("c-hit"),
        record("c-miss", cached_prompt_tokens=3),
    )
    assert [pb.RecordStatus.Name(r.status) for r in replays.records] == [
        "RECORD_STATUS_DUPLICATE",
        "RECORD_STATUS_CONFLICT",  # the same call, now claiming nothing was served
        "RECORD_STATUS_CONFLICT",  # and the other, now claiming a hit
    ]
    assert stored_rows(ledger) == 2


def test_chargeback_shows_the_cached_prompt_tokens_over_the_wire(stub, keys: Keys) -> None:
    send(
        stub,
        keys.admin,
        record("a1", finished_at_us=PAST_START_US + 10, cached_prompt_tokens=10),
        record("a2", finished_at_us=PAST_START_US + 20, unit_us=2_000_000, cached_prompt_tokens=4),
        usage_to_pb(missed("a3", finished_at_us=PAST_START_US + 30, cached_prompt_tokens=1)),
        record("g1", tenant="globex", finished_at_us=PAST_START_US + 40),
    )
    report = stub.GetChargebackReport(
        pb.GetChargebackReportRequest(period=PAST, group_by=["tenant"]), metadata=bearer(keys.admin)
    )
    assert [
        (dict(r.group), r.prompt_tokens, r.cached_prompt_tokens, r.unit_us, r.cost_micros) for r in report.rows
    ] == [
        ({"tenant": "acme"}, 30, 15, 4_000_000, 4_500),  # 1,500 micros per core·s; a3's miss credited
        ({"tenant": "globex"}, 10, 0, 1_000_000, 1_500),
    ]
    own = stub.GetChargebackReport(
        pb.GetChargebackReportRequest(period=PAST, group_by=["tenant"]), metadata=bearer(keys.globex)
    )
    assert [(dict(r.group), r.cached_prompt_tokens) for r in own.rows] == [({"tenant": "globex"}, 0)]
