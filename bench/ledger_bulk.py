"""bench/ledger.py's bulk rows for the report timings, generated inside the database (INSERT … SELECT over
generate_series / a recursive CTE): usage spread over tenants, models, cost centers, teams and days, and a month
of per-minute idle records for two devices."""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Boolean, Engine, String, case, cast, func, insert, literal, select, text

from billing.models import IdleRow, UsageRow
from billing.period import US_PER_MINUTE, parse_period

BIG_MONTH = "2026-09"
NUM_TENANTS = 4


def _series(engine: Engine, count: int):  # type: ignore[no-untyped-def]
    """A one-column selectable of 0..count-1 named i."""
    if engine.dialect.name == "postgresql":
        return select(func.generate_series(0, count - 1).column_valued("i").label("i")).subquery()
    numbers = select(literal(0).label("i")).cte("numbers", recursive=True)
    numbers = numbers.union_all(select(numbers.c.i + 1).where(numbers.c.i < count - 1))
    return numbers


def _text(prefix: str, number) -> object:  # type: ignore[no-untyped-def]
    return literal(prefix) + cast(number, String)


def generate_usage(engine: Engine, count: int, now_us: int) -> None:
    period = parse_period(BIG_MONTH)
    step_us = (period.end_us - period.start_us - 1_000_000) // count
    i = cast(_series(engine, count).c.i, BigInteger)
    gpu = i % 3 == 2
    missed = i % 20 == 0
    finished = period.start_us + 1_000_000 + i * step_us
    labels = literal('{"cost_center":"cc-') + cast(i % 20, String) + '","team":"team-' + cast(i % 10, String) + '"}'
    columns = {
        "call_id": _text("bulk-", i),
        "tenant_id": 1 + i % NUM_TENANTS,
        "labels": cast(labels, JSON) if engine.dialect.name == "postgresql" else labels,
        "cost_center": _text("cc-", i % 20),
        "team": _text("team-", i % 10),
        "model": case((i % 3 == 0, "m-tiny"), (i % 3 == 1, "m-small"), else_="m-big"),
        "device_kind": case((gpu, "cuda"), else_="cpu"),
        "device_id": case((gpu, "GPU-bench"), else_="cpu:bench"),
        "unit": case((gpu, "sm_us"), else_="core_us"),
        "num_units": case((gpu, 132), else_=4),
        "unit_us": 1_000 + (i % 997) * 1_000,
        "prompt_tokens": i % 500,
        "completion_tokens": i % 200,
        "received_at_us": finished - 50_000,
        "dispatched_at_us": finished - 40_000,
        "first_token_at_us": finished - 30_000,
        "finished_at_us": finished,
        "deadline_at_us": case((missed, finished - 1), else_=finished + 10_000),
        "deadline_met": cast(case((missed, 0), else_=1), Boolean)
        if engine.dialect.name == "postgresql"
        else case((missed, 0), else_=1),
        "outcome": case((missed, "deadline_exceeded"), else_="ok"),
        "payload_digest": literal("bulk-placeholder"),
        "ingested_at_us": literal(now_us),
    }
    statement = insert(UsageRow).from_select(list(columns), select(*columns.values()))
    with engine.begin() as connection:
        connection.execute(statement)


def generate_idle(engine: Engine, now_us: int) -> None:
    period = parse_period(BIG_MONTH)
    minutes = (period.end_us - period.start_us) // US_PER_MINUTE
    i = cast(_series(engine, 2 * minutes).c.i, BigInteger)
    gpu = i % 2 == 1
    wall = case((gpu, 132 * US_PER_MINUTE), else_=4 * US_PER_MINUTE)
    columns = {
        "record_id": _text("idle-", i),
        "device_id": case((gpu, "GPU-bench"), else_="cpu:bench"),
        "unit": case((gpu, "sm_us"), else_="core_us"),
        "num_units": case((gpu, 132), else_=4),
        "minute_start_us": period.start_us + (i // 2) * US_PER_MINUTE,
        "idle_unit_us": wall // 2,
        "wall_unit_us": wall,
        "payload_digest": literal("bulk-placeholder"),
        "ingested_at_us": literal(now_us),
    }
    with engine.begin() as connection:
        connection.execute(insert(IdleRow).from_select(list(columns), select(*columns.values())))


def analyze(engine: Engine) -> None:
    with engine.begin() as connection:
        connection.execute(text("ANALYZE"))
