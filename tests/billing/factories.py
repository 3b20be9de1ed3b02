"""Builders of valid records for the billing tests."""

from __future__ import annotations

from typing import Any

from billing.period import US_PER_MINUTE, parse_period
from billing.records import IdleRecord, UsageRecord

PERIOD = "2026-10"
START_US = parse_period(PERIOD).start_us
US_PER_HOUR = 3_600_000_000


def usage(call_id: str, **overrides: Any) -> UsageRecord:
    """A valid CPU usage record finishing ``finished_at_us`` (default: one hour into 2026-10)."""
    finished = overrides.pop("finished_at_us", START_US + US_PER_HOUR)
    fields: dict[str, Any] = dict(
        call_id=call_id,
        tenant="acme",
        labels={"cost_center": "cc-1", "team": "search"},
        model="tiny",
        device_kind="cpu",
        device_id="cpu:host-a",
        unit="core_us",
        num_units=4,
        unit_us=1_000_000,
        prompt_tokens=10,
        completion_tokens=20,
        received_at_us=finished - 5_000,
        dispatched_at_us=finished - 4_000,
        first_token_at_us=finished - 3_000,
        finished_at_us=finished,
        deadline_at_us=finished + 1_000,
        deadline_met=True,
        outcome="ok",
    )
    fields.update(overrides)
    return UsageRecord(**fields)


def missed(call_id: str, **overrides: Any) -> UsageRecord:
    """A request admitted but finished after its deadline."""
    overrides.setdefault("finished_at_us", START_US + US_PER_HOUR)
    overrides.setdefault("deadline_at_us", overrides["finished_at_us"] - 1)
    return usage(call_id, deadline_met=False, outcome="deadline_exceeded", **overrides)


def gpu_usage(call_id: str, **overrides: Any) -> UsageRecord:
    overrides = dict(device_kind="cuda", device_id="GPU-0000-test", unit="sm_us", num_units=132) | overrides
    return usage(call_id, **overrides)


def idle(
    device_id: str,
    minute: int,
    idle_unit_us: int,
    *,
    num_units: int = 4,
    unit: str = "core_us",
    wall_unit_us: int | None = None,
    start_us: int = START_US,
) -> IdleRecord:
    return IdleRecord(
        record_id=f"{device_id}:boot-1:{minute}",
        device_id=device_id,
        unit=unit,
        num_units=num_units,
        minute_start_us=start_us + minute * US_PER_MINUTE,
        idle_unit_us=idle_unit_us,
        wall_unit_us=US_PER_MINUTE * num_units if wall_unit_us is None else wall_unit_us,
    )
