"""The outbox on its own: a waiter hears of its record only once it is on disk."""

from __future__ import annotations

import asyncio
import functools
import json
import sqlite3

import pytest
from sqlalchemy import select

from billing.db import unit_of_work
from billing.models import UsageRow
from billing.records import Door, RequestKind, UsageRecord
from billing.tenants import create_tenant
from services.metering.outbox import Outbox, OutboxConflict
from services.metering.shipper import LedgerSink, Shipper
from tests.billing.conftest import Ledger

T0_US = 1_795_000_000_000_000


def builder(call_id: str) -> functools.partial:
    return functools.partial(
        UsageRecord,
        call_id=call_id,
        tenant="acme",
        labels={},
        model="m",
        device_kind="cpu",
        device_id="cpu:test",
        unit="core_us",
        num_units=1,
        unit_us=1234,
        prompt_tokens=3,
        completion_tokens=5,
        received_at_us=T0_US,
        dispatched_at_us=T0_US,
        first_token_at_us=T0_US + 10,
        finished_at_us=T0_US + 20,
        deadline_at_us=T0_US + 1000,
        deadline_met=True,
        outcome="ok",
    )


def test_a_waiter_gets_its_record_once_it_is_on_disk(tmp_path):
    outbox = Outbox(tmp_path / "outbox.db")
    try:
        future = outbox.expect("r1")
        outbox.append([builder("r1")], [])
        record = future.result(timeout=10)
        assert record.call_id == "r1" and record.unit_us == 1234
        with sqlite3.connect(tmp_path / "outbox.db") as conn:
            assert conn.execute("SELECT record_id FROM outbox WHERE kind = 'usage'").fetchall() == [("r1",)]
    finally:
        outbox.close()


def test_a_record_id_already_held_with_another_payload_is_a_conflict_kept_aside_not_a_silent_loss(tmp_path):
    outbox = Outbox(tmp_path / "outbox.db")
    try:
        first = outbox.expect("r1")
        outbox.append([builder("r1")], [])
        assert first.result(timeout=10).unit_us == 1234
        again, other = outbox.expect("r1"), outbox.expect("r2")
        outbox.append([functools.partial(builder("r1"), unit_us=999), builder("r2")], [])
        with pytest.raises(OutboxConflict, match="r1"):
            again.result(timeout=10)
        assert other.result(timeout=10).call_id == "r2"  # the rest of the batch is committed
        assert outbox.counts() == {"pending": 2, "delivered": 0, "dead": 0, "conflicts": 1}
        with sqlite3.connect(tmp_path / "outbox.db") as conn:
            (payload,) = conn.execute("SELECT payload FROM outbox_conflicts WHERE record_id = 'r1'").fetchone()
            (held,) = conn.execute("SELECT payload FROM outbox WHERE record_id = 'r1'").fetchone()
        assert json.loads(payload)["unit_us"] == 999 and json.loads(held)["unit_us"] == 1234
    finally:
        outbox.close()


def test_the_same_record_appended_twice_is_held_once_and_both_waiters_hear_it_is_on_disk(tmp_path):
    outbox = Outbox(tmp_path / "outbox.db")
    try:
        first = outbox.expect("r1")
        outbox.append([builder("r1")], [])
        first.result(timeout=10)
        again = outbox.expect("r1")
        outbox.append([builder("r1")], [])
        assert again.result(timeout=10).call_id == "r1"
        assert outbox.counts() == {"pending": 1, "delivered": 0, "dead": 0, "conflicts": 0}
    finally:
        outbox.close()


# A usage row exactly as a replica before the rename of issue 30 wrote it: the call's id under "request_id", the
# caller's under "client_request_id" (the frozen zq.usage.v1 keys). An upgraded replica must still ship it.
OLD_REPLICA_PAYLOAD = (
    '{"request_id": "r-old", "tenant": "acme", "labels": {}, "model": "m", "device_kind": "cpu", '
    '"device_id": "cpu:test", "unit": "core_us", "num_units": 1, "unit_us": 1234, "prompt_tokens": 3, '
    '"completion_tokens": 5, "received_at_us": 1795000000000000, "dispatched_at_us": 1795000000000000, '
    '"first_token_at_us": 1795000000000010, "finished_at_us": 1795000000000020, '
    '"deadline_at_us": 1795000000001000, "deadline_met": true, "outcome": "ok", '
    '"client_request_id": "caller-7", "service_class": "standard"}'
)


def test_a_row_an_older_replica_wrote_still_reads_back_and_the_same_record_appended_again_is_no_conflict(tmp_path):
    outbox = Outbox(tmp_path / "outbox.db")
    try:
        with sqlite3.connect(tmp_path / "outbox.db") as conn:
            conn.execute(
                "INSERT INTO outbox (kind, record_id, payload, created_at_us) VALUES ('usage', 'r-old', ?, 1)",
                (OLD_REPLICA_PAYLOAD,),
            )
        (row,) = outbox.pending(10)
        assert row.record == builder("r-old")(request_id="caller-7")
        assert row.record.call_id == "r-old" and row.record.request_id == "caller-7"
        assert row.record.request_kind is RequestKind.PLAIN  # written before kinds: plain
        assert row.record.door is Door.GRPC  # written before doors: grpc, the only door there was
        again = outbox.expect("r-old")
        outbox.append([functools.partial(builder("r-old"), request_id="caller-7")], [])
        assert again.result(timeout=10).call_id == "r-old"  # held with the very same payload: not a conflict
        assert outbox.counts() == {"pending": 1, "delivered": 0, "dead": 0, "conflicts": 0}
    finally:
        outbox.close()


def test_a_record_keeps_its_request_kind_on_disk_and_another_kind_under_its_id_is_a_conflict(tmp_path):
    outbox = Outbox(tmp_path / "outbox.db")
    try:
        chat = outbox.expect("r-chat")
        outbox.append([functools.partial(builder("r-chat"), request_kind="chat")], [])
        assert chat.result(timeout=10).request_kind is RequestKind.CHAT
        with sqlite3.connect(tmp_path / "outbox.db") as conn:
            (payload,) = conn.execute("SELECT payload FROM outbox WHERE record_id = 'r-chat'").fetchone()
        assert json.loads(payload)["request_kind"] == "chat"
        assert [row.record.request_kind for row in outbox.pending(10)] == [RequestKind.CHAT]
        again = outbox.expect("r-chat")
        outbox.append([functools.partial(builder("r-chat"), request_kind="constrained")], [])
        with pytest.raises(OutboxConflict, match="r-chat"):
            again.result(timeout=10)
        assert outbox.counts() == {"pending": 1, "delivered": 0, "dead": 0, "conflicts": 1}
    finally:
        outbox.close()


@pytest.mark.parametrize("ledger", ["sqlite"], indirect=True)
def test_the_shipper_delivers_each_records_kind_to_the_ledger(tmp_path, ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
    outbox = Outbox(tmp_path / "outbox.db")
    try:
        kinds = {f"r-{kind.value}": kind for kind in RequestKind}
        outbox.append([functools.partial(builder(call_id), request_kind=kind) for call_id, kind in kinds.items()], [])
        assert outbox.flush()
        assert asyncio.run(Shipper(outbox, LedgerSink(ledger.sessions)).ship_once()) == len(kinds)
        assert outbox.counts()["delivered"] == len(kinds)
    finally:
        outbox.close()
    with ledger.sessions() as session:
        stored = dict(session.execute(select(UsageRow.call_id, UsageRow.request_kind)).all())
    assert stored == {call_id: kind.value for call_id, kind in kinds.items()}


def test_a_record_keeps_its_door_on_disk_and_another_door_under_its_id_is_a_conflict(tmp_path):
    outbox = Outbox(tmp_path / "outbox.db")
    try:
        http = outbox.expect("r-http")
        outbox.append([functools.partial(builder("r-http"), door="http")], [])
        assert http.result(timeout=10).door is Door.HTTP
        with sqlite3.connect(tmp_path / "outbox.db") as conn:
            (payload,) = conn.execute("SELECT payload FROM outbox WHERE record_id = 'r-http'").fetchone()
        assert json.loads(payload)["door"] == "http"
        assert [row.record.door for row in outbox.pending(10)] == [Door.HTTP]
        again = outbox.expect("r-http")
        outbox.append([functools.partial(builder("r-http"), door="grpc")], [])
        with pytest.raises(OutboxConflict, match="r-http"):
            again.result(timeout=10)
        assert outbox.counts() == {"pending": 1, "delivered": 0, "dead": 0, "conflicts": 1}
    finally:
        outbox.close()


def test_a_row_a_replica_before_doors_wrote_reads_as_grpc_and_the_same_record_again_is_no_conflict(tmp_path):
    outbox = Outbox(tmp_path / "outbox.db")
    before_doors = builder("r-chat")(request_kind="chat").to_v1_payload()
    del before_doors["door"]
    try:
        with sqlite3.connect(tmp_path / "outbox.db") as conn:
            conn.execute(
                "INSERT INTO outbox (kind, record_id, payload, created_at_us) VALUES ('usage', 'r-chat', ?, 1)",
                (json.dumps(before_doors),),
            )
        (row,) = outbox.pending(10)
        assert row.record == builder("r-chat")(request_kind="chat", door=Door.GRPC)
        again = outbox.expect("r-chat")
        outbox.append([functools.partial(builder("r-chat"), request_kind="chat", door="grpc")], [])
        assert again.result(timeout=10).door is Door.GRPC  # the record held, by digest: not a conflict
        assert outbox.counts() == {"pending": 1, "delivered": 0, "dead": 0, "conflicts": 0}
    finally:
        outbox.close()


def test_the_shipper_delivers_each_records_door_to_the_ledger(tmp_path, ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
    outbox = Outbox(tmp_path / "outbox.db")
    try:
        doors = {f"r-{door.value}": door for door in Door}
        outbox.append([functools.partial(builder(call_id), door=door) for call_id, door in doors.items()], [])
        assert outbox.flush()
        assert asyncio.run(Shipper(outbox, LedgerSink(ledger.sessions)).ship_once()) == len(doors)
        assert outbox.counts()["delivered"] == len(doors)
    finally:
        outbox.close()
    with ledger.sessions() as session:
        stored = dict(session.execute(select(UsageRow.call_id, UsageRow.door)).all())
    assert stored == {call_id: door.value for call_id, door in doors.items()}


def test_a_record_keeps_its_cached_prompt_tokens_on_disk_and_another_count_under_its_id_is_a_conflict(tmp_path):
    outbox = Outbox(tmp_path / "outbox.db")
    try:
        hit = outbox.expect("r-hit")
        outbox.append([functools.partial(builder("r-hit"), cached_prompt_tokens=2)], [])  # 2 of its 3 prompt tokens
        assert hit.result(timeout=10).cached_prompt_tokens == 2
        with sqlite3.connect(tmp_path / "outbox.db") as conn:
            (payload,) = conn.execute("SELECT payload FROM outbox WHERE record_id = 'r-hit'").fetchone()
        assert json.loads(payload)["cached_prompt_tokens"] == 2
        assert [row.record.cached_prompt_tokens for row in outbox.pending(10)] == [2]
        again = outbox.expect("r-hit")
        outbox.append([functools.partial(builder("r-hit"), cached_prompt_tokens=0)], [])
        with pytest.raises(OutboxConflict, match="r-hit"):
            again.result(timeout=10)
        assert outbox.counts() == {"pending": 1, "delivered": 0, "dead": 0, "conflicts": 1}
    finally:
        outbox.close()


def test_a_row_a_replica_before_the_cache_wrote_reads_as_0_and_the_same_record_again_is_no_conflict(tmp_path):
    outbox = Outbox(tmp_path / "outbox.db")
    before_the_cache = builder("r-http")(door="http").to_v1_payload()
    del before_the_cache["cached_prompt_tokens"]
    try:
        with sqlite3.connect(tmp_path / "outbox.db") as conn:
            conn.execute(
                "INSERT INTO outbox (kind, record_id, payload, created_at_us) VALUES ('usage', 'r-http', ?, 1)",
                (json.dumps(before_the_cache),),
            )
        (row,) = outbox.pending(10)
        assert row.record == builder("r-http")(door="http", cached_prompt_tokens=0)
        again = outbox.expect("r-http")
        outbox.append([functools.partial(builder("r-http"), door="http", cached_prompt_tokens=0)], [])
        assert again.result(timeout=10).cached_prompt_tokens == 0  # the record held, by digest: not a conflict
        assert outbox.counts() == {"pending": 1, "delivered": 0, "dead": 0, "conflicts": 0}
    finally:
        outbox.close()


def test_the_shipper_delivers_each_records_cached_prompt_tokens_to_the_ledger(tmp_path, ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
    outbox = Outbox(tmp_path / "outbox.db")
    try:
        counts = {f"r-{cached}": cached for cached in range(4)}  # none to all of the 3 prompt tokens
        outbox.append([functools.partial(builder(c), cached_prompt_tokens=n) for c, n in counts.items()], [])
        assert outbox.flush()
        assert asyncio.run(Shipper(outbox, LedgerSink(ledger.sessions)).ship_once()) == len(counts)
        assert outbox.counts()["delivered"] == len(counts)
    finally:
        outbox.close()
    with ledger.sessions() as session:
        stored = dict(session.execute(select(UsageRow.call_id, UsageRow.cached_prompt_tokens)).all())
    assert stored == counts


def test_the_shipper_delivers_an_int8_record_and_a_row_a_replica_before_weight_dtypes_wrote(
    tmp_path, ledger: Ledger
) -> None:
    """Issue 34: a quantized replica's record keeps "int8" from the outbox to the ledger; a row queued before weight
    dtypes lacks the key, reads as unknown ('') and still ships."""
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
    before_weight_dtypes = builder("r-old")(door="http").to_v1_payload()
    del before_weight_dtypes["weight_dtype"]
    outbox = Outbox(tmp_path / "outbox.db")
    try:
        with sqlite3.connect(tmp_path / "outbox.db") as conn:
            conn.execute(
                "INSERT INTO outbox (kind, record_id, payload, created_at_us) VALUES ('usage', 'r-old', ?, 1)",
                (json.dumps(before_weight_dtypes),),
            )
        outbox.append([functools.partial(builder("r-int8"), weight_dtype="int8")], [])
        assert outbox.flush()
        assert {row.record.call_id: row.record.weight_dtype for row in outbox.pending(10)} == {
            "r-old": "",
            "r-int8": "int8",
        }
        assert asyncio.run(Shipper(outbox, LedgerSink(ledger.sessions)).ship_once()) == 2
        assert outbox.counts()["delivered"] == 2
    finally:
        outbox.close()
    with ledger.sessions() as session:
        stored = dict(session.execute(select(UsageRow.call_id, UsageRow.weight_dtype)).all())
    assert stored == {"r-old": "", "r-int8": "int8"}
