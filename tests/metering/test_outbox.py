"""The outbox on its own: a waiter hears of its record only once it is on disk."""

from __future__ import annotations

import functools
import json
import sqlite3

import pytest

from billing.records import UsageRecord
from services.metering.outbox import Outbox, OutboxConflict

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
        again = outbox.expect("r-old")
        outbox.append([functools.partial(builder("r-old"), request_id="caller-7")], [])
        assert again.result(timeout=10).call_id == "r-old"  # held with the very same payload: not a conflict
        assert outbox.counts() == {"pending": 1, "delivered": 0, "dead": 0, "conflicts": 0}
    finally:
        outbox.close()
