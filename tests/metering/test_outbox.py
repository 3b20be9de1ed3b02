"""The outbox on its own: a waiter hears of its record only once it is on disk."""
from __future__ import annotations

import functools
import sqlite3

from billing.records import UsageRecord
from services.metering.outbox import Outbox

T0_US = 1_795_000_000_000_000


def builder(request_id: str) -> functools.partial:
    return functools.partial(UsageRecord, request_id=request_id, tenant="acme", labels={}, model="m",
                             device_kind="cpu", device_id="cpu:test", unit="core_us", num_units=1, unit_us=1234,
                             prompt_tokens=3, completion_tokens=5, received_at_us=T0_US, dispatched_at_us=T0_US,
                             first_token_at_us=T0_US + 10, finished_at_us=T0_US + 20, deadline_at_us=T0_US + 1000,
                             deadline_met=True, outcome="ok")


def test_a_waiter_gets_its_record_once_it_is_on_disk(tmp_path):
    outbox = Outbox(tmp_path / "outbox.db")
    try:
        future = outbox.expect("r1")
        outbox.append([builder("r1")], [])
        record = future.result(timeout=10)
        assert record.request_id == "r1" and record.unit_us == 1234
        with sqlite3.connect(tmp_path / "outbox.db") as conn:
            assert conn.execute("SELECT record_id FROM outbox WHERE kind = 'usage'").fetchall() == [("r1",)]
    finally:
        outbox.close()
