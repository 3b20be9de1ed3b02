"""Chargeback groupings and device utilisation against a hand-built month with known answers."""

from __future__ import annotations

import dataclasses

import pytest

from billing.chargeback import ChargebackRow, chargeback_report, percent_text, ratio_ppm
from billing.db import unit_of_work
from billing.errors import InvalidArgument, InvalidPeriod
from billing.ledger import ingest_idle, ingest_usage, query_usage
from billing.period import US_PER_DAY, US_PER_MINUTE
from billing.pricing import add_price
from billing.tenants import create_tenant
from tests.billing.conftest import Ledger
from tests.billing.factories import PERIOD, START_US, US_PER_HOUR, gpu_usage, idle, missed, usage

DAY_1 = START_US + US_PER_HOUR
DAY_2 = START_US + US_PER_DAY + US_PER_HOUR
CPU_WALL = 4 * US_PER_MINUTE  # one minute of the 4-core host
GPU_WALL = 132 * US_PER_MINUTE


@pytest.fixture
def month(ledger: Ledger) -> Ledger:
    """Four requests, one missed, of three request kinds, two through the HTTP door, three served some of their 10
    prompt tokens by the prefix cache; the idle records leave exactly the billed time busy."""
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
        create_tenant(session, "globex")
        add_price(session, "tiny", "core_us", 1_000, "USD", 0)
        add_price(session, "big", "sm_us", 2, "USD", 0)
        ingest_usage(
            session,
            [
                usage("a1", finished_at_us=DAY_1, unit_us=2_000_000, door="http", cached_prompt_tokens=4),
                missed(
                    "a2",
                    finished_at_us=DAY_2,
                    unit_us=3_000_000,
                    labels={"cost_center": "cc-1", "team": "ads"},
                    request_kind="chat",
                    cached_prompt_tokens=10,
                ),
                gpu_usage(
                    "a3", model="big", finished_at_us=DAY_2, unit_us=50_000_000, labels={}, request_kind="constrained"
                ),
                usage(
                    "g1",
                    tenant="globex",
                    finished_at_us=DAY_1,
                    unit_us=1_000_000,
                    labels={"cost_center": "cc-2", "team": "search"},
                    request_kind="chat",
                    door="http",
                    cached_prompt_tokens=6,
                ),
            ],
        )
        ingest_idle(
            session,
            [
                *(idle("cpu:host-a", minute, CPU_WALL - 1_000_000) for minute in (60, 61, 62)),
                idle("cpu:host-a", 24 * 60 + 60, CPU_WALL - 3_000_000),
                idle("GPU-0000-test", 24 * 60 + 60, GPU_WALL - 50_000_000, num_units=132, unit="sm_us"),
                idle("cpu:host-a", 31 * 24 * 60, 0),  # 1 November: outside the period
            ],
        )
    return ledger


def rows(ledger: Ledger, by: list[str]) -> list[tuple]:
    with ledger.sessions() as session:
        report = chargeback_report(session, PERIOD, by)
    return [
        (*(v for _, v in r.group), r.unit, r.num_requests, r.num_deadline_met, r.unit_us, r.cost_micros, r.attainment)
        for r in report.rows
    ]


@pytest.mark.parametrize(
    ("by", "expected"),
    [
        (
            ["cost_center"],
            [
                ("(none)", "sm_us", 1, 1, 50_000_000, 100, "100.00%"),
                ("cc-1", "core_us", 2, 1, 5_000_000, 2_000, "50.00%"),  # the miss is credited: 3000 − 3000
                ("cc-2", "core_us", 1, 1, 1_000_000, 1_000, "100.00%"),
            ],
        ),
        (
            ["team"],
            [
                ("(none)", "sm_us", 1, 1, 50_000_000, 100, "100.00%"),
                ("ads", "core_us", 1, 0, 3_000_000, 0, "0.00%"),
                ("search", "core_us", 2, 2, 3_000_000, 3_000, "100.00%"),
            ],
        ),
        (
            ["model"],
            [("big", "sm_us", 1, 1, 50_000_000, 100, "100.00%"), ("tiny", "core_us", 3, 2, 6_000_000, 3_000, "66.67%")],
        ),
        (
            ["tenant"],
            [
                ("acme", "core_us", 2, 1, 5_000_000, 2_000, "50.00%"),
                ("acme", "sm_us", 1, 1, 50_000_000, 100, "100.00%"),
                ("globex", "core_us", 1, 1, 1_000_000, 1_000, "100.00%"),
            ],
        ),
        (
            ["day"],
            [
                ("2026-10-01", "core_us", 2, 2, 3_000_000, 3_000, "100.00%"),
                ("2026-10-02", "core_us", 1, 0, 3_000_000, 0, "0.00%"),
                ("2026-10-02", "sm_us", 1, 1, 50_000_000, 100, "100.00%"),
            ],
        ),
        (
            ["tenant", "team"],
            [
                ("acme", "(none)", "sm_us", 1, 1, 50_000_000, 100, "100.00%"),
                ("acme", "ads", "core_us", 1, 0, 3_000_000, 0, "0.00%"),
                ("acme", "search", "core_us", 1, 1, 2_000_000, 2_000, "100.00%"),
                ("globex", "search", "core_us", 1, 1, 1_000_000, 1_000, "100.00%"),
            ],
        ),
        (
            ["request_kind"],
            [
                ("chat", "core_us", 2, 1, 4_000_000, 1_000, "50.00%"),  # a2's miss credited: 4000 − 3000
                ("constrained", "sm_us", 1, 1, 50_000_000, 100, "100.00%"),
                ("plain", "core_us", 1, 1, 2_000_000, 2_000, "100.00%"),
            ],
        ),
        (
            ["tenant", "request_kind"],
            [
                ("acme", "chat", "core_us", 1, 0, 3_000_000, 0, "0.00%"),
                ("acme", "constrained", "sm_us", 1, 1, 50_000_000, 100, "100.00%"),
                ("acme", "plain", "core_us", 1, 1, 2_000_000, 2_000, "100.00%"),
                ("globex", "chat", "core_us", 1, 1, 1_000_000, 1_000, "100.00%"),
            ],
        ),
        (
            ["door"],
            [
                ("grpc", "core_us", 1, 0, 3_000_000, 0, "0.00%"),  # a2's miss credited: 3000 − 3000
                ("grpc", "sm_us", 1, 1, 50_000_000, 100, "100.00%"),
                ("http", "core_us", 2, 2, 3_000_000, 3_000, "100.00%"),
            ],
        ),
        (
            ["request_kind", "door"],
            [
                ("chat", "grpc", "core_us", 1, 0, 3_000_000, 0, "0.00%"),
                ("chat", "http", "core_us", 1, 1, 1_000_000, 1_000, "100.00%"),
                ("constrained", "grpc", "sm_us", 1, 1, 50_000_000, 100, "100.00%"),
                ("plain", "http", "core_us", 1, 1, 2_000_000, 2_000, "100.00%"),
            ],
        ),
        ([], [("core_us", 3, 2, 6_000_000, 3_000, "66.67%"), ("sm_us", 1, 1, 50_000_000, 100, "100.00%")]),
    ],
    ids=lambda value: ",".join(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else None,
)
def test_groupings_match_the_hand_computed_answers(month: Ledger, by: list[str], expected: list[tuple]) -> None:
    assert rows(month, by) == expected


@pytest.mark.parametrize("split", ["request_kind", "door"])
@pytest.mark.parametrize("within", [[], ["tenant"], ["model", "day"]], ids=lambda by: ",".join(by) or "nothing")
def test_grouping_by_request_kind_or_door_splits_usage_exactly(ledger: Ledger, within: list[str], split: str) -> None:
    """Each row grouped further by kind or door sums back to the row it splits: requests, deadlines met, unit·µs and
    tokens exactly. Cost is priced per group (rounded once per group), so with prices that leave no fraction it sums
    too."""
    kinds = ["plain", "chat", "constrained", "chat_constrained"]
    doors = ["grpc", "http"]
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
        create_tenant(session, "globex")
        add_price(session, "tiny", "core_us", 1_000, "USD", 0)
        add_price(session, "big", "sm_us", 2, "USD", 0)
        records = []
        for i in range(40):
            make = gpu_usage if i % 5 == 0 else missed if i % 7 == 0 else usage
            records.append(
                make(
                    f"r{i}",
                    tenant=("acme", "globex")[i % 2],
                    model="big" if i % 5 == 0 else "tiny",
                    finished_at_us=START_US + (i % 3) * US_PER_DAY + i,
                    unit_us=1_000_000 * (i % 4 + 1),
                    prompt_tokens=i,
                    completion_tokens=2 * i + 1,
                    request_kind=kinds[i % 4 if i < 36 else 0],
                    door=doors[i % 7 % 2],
                    cached_prompt_tokens=i * (i % 3) // 2,  # none, half or all of the prompt
                )
            )
        ingest_usage(session, records)
    with ledger.sessions() as session:
        whole = chargeback_report(session, PERIOD, within)
        parts = chargeback_report(session, PERIOD, [*within, split])
    values = {"request_kind": set(kinds), "door": set(doors)}[split]
    assert {value for row in parts.rows for name, value in row.group if name == split} == values
    assert len(parts.rows) > len(whole.rows)
    sums: dict[tuple, list[int]] = {}
    for row in parts.rows:
        key = (tuple(pair for pair in row.group if pair[0] != split), row.unit, row.currency)
        values = (row.num_requests, row.num_deadline_met, row.unit_us, row.prompt_tokens, row.cached_prompt_tokens)
        values += (row.completion_tokens, row.cost_micros)
        sums[key] = [a + b for a, b in zip(sums.get(key, [0] * 7), values, strict=True)]
    assert sums == {
        (row.group, row.unit, row.currency): [
            row.num_requests,
            row.num_deadline_met,
            row.unit_us,
            row.prompt_tokens,
            row.cached_prompt_tokens,
            row.completion_tokens,
            row.cost_micros,
        ]
        for row in whole.rows
    }


@pytest.mark.parametrize(
    ("by", "expected"),
    [
        (["tenant"], [("acme", "core_us", 20, 14), ("acme", "sm_us", 10, 0), ("globex", "core_us", 10, 6)]),
        (["door"], [("grpc", "core_us", 10, 10), ("grpc", "sm_us", 10, 0), ("http", "core_us", 20, 10)]),
        ([], [("core_us", 30, 20), ("sm_us", 10, 0)]),
    ],
    ids=lambda value: ",".join(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else None,
)
def test_each_group_shows_the_prompt_tokens_the_cache_served(month: Ledger, by: list[str], expected: list) -> None:
    """Beside each group's prompt tokens, how many of them the prefix cache served; the costs above
    (test_groupings_match_the_hand_computed_answers, on the same month) are the device time's alone."""
    with month.sessions() as session:
        report = chargeback_report(session, PERIOD, by)
    assert [
        (*(v for _, v in r.group), r.unit, r.prompt_tokens, r.cached_prompt_tokens) for r in report.rows
    ] == expected


def test_the_prompt_tokens_the_cache_served_change_no_cost(month: Ledger) -> None:
    """Another tenant makes the month's calls again with nothing served by the cache: its rows have the same requests,
    device time, tokens and cost; only the cached count differs. Device time alone prices a call."""
    with month.sessions() as session:
        calls = query_usage(session, start_us=START_US, end_us=START_US + 2 * US_PER_DAY).records
        cached = chargeback_report(session, PERIOD, ["door"])
    with unit_of_work(month.sessions) as session:
        create_tenant(session, "initech")
        ingest_usage(
            session,
            [
                dataclasses.replace(call, call_id=f"x-{call.call_id}", tenant="initech", cached_prompt_tokens=0)
                for call in calls
            ],
        )
    with month.sessions() as session:
        uncached = chargeback_report(session, PERIOD, ["door"], tenant="initech")
    assert [r.cached_prompt_tokens for r in cached.rows] == [10, 0, 10]
    assert [r.cached_prompt_tokens for r in uncached.rows] == [0, 0, 0]
    assert [_usage_and_cost(r) for r in uncached.rows] == [_usage_and_cost(r) for r in cached.rows]


def _usage_and_cost(row: ChargebackRow) -> tuple:
    return (
        row.group,
        row.unit,
        row.num_requests,
        row.num_deadline_met,
        row.unit_us,
        row.prompt_tokens,
        row.completion_tokens,
        row.cost_micros,
    )


def test_device_utilisation_and_conservation(month: Ledger) -> None:
    with month.sessions() as session:
        report = chargeback_report(session, PERIOD, ["model"])
    devices = {d.device_id: d for d in report.devices}
    cpu, gpu = devices["cpu:host-a"], devices["GPU-0000-test"]
    assert (cpu.wall_unit_us, cpu.busy_unit_us, cpu.billed_unit_us) == (4 * CPU_WALL, 6_000_000, 6_000_000)
    assert (gpu.wall_unit_us, gpu.busy_unit_us, gpu.billed_unit_us) == (GPU_WALL, 50_000_000, 50_000_000)
    # Σ billed + idle = wall × units, for every device.
    assert cpu.unaccounted_unit_us == gpu.unaccounted_unit_us == 0
    assert (cpu.utilisation_ppm, gpu.utilisation_ppm) == (6_250, 6_313)
    assert [(p.day, p.unit, p.utilisation_ppm) for p in report.timeline] == [
        ("2026-10-01", "core_us", 4_167),
        ("2026-10-02", "core_us", 12_500),
        ("2026-10-02", "sm_us", 6_313),
    ]


def test_a_tenant_scoped_report_leaves_out_other_tenants_and_devices(month: Ledger) -> None:
    with month.sessions() as session:
        report = chargeback_report(session, PERIOD, ["tenant"], tenant="globex")
    assert [(r.group, r.cost_micros) for r in report.rows] == [((("tenant", "globex"),), 1_000)]
    assert report.devices == () and report.timeline == ()


def test_bad_groupings_and_periods_name_the_field(month: Ledger) -> None:
    with month.sessions() as session:
        with pytest.raises(InvalidArgument) as caught:
            chargeback_report(session, PERIOD, ["region"])
        assert caught.value.field == "by"
        with pytest.raises(InvalidArgument):
            chargeback_report(session, PERIOD, ["team", "team"])
        with pytest.raises(InvalidArgument):
            chargeback_report(session, PERIOD, ["request_type"])
        with pytest.raises(InvalidArgument):
            chargeback_report(session, PERIOD, ["door", "door"])
        with pytest.raises(InvalidPeriod) as period:
            chargeback_report(session, "2026-13", ["team"])
        assert period.value.field == "period"


@pytest.mark.parametrize(
    ("numerator", "denominator", "ppm", "text"),
    [
        (1, 3, 333_333, "33.33%"),
        (2, 3, 666_667, "66.67%"),
        (1, 8, 125_000, "12.50%"),
        (0, 0, 0, "—"),
        (5, 5, 1_000_000, "100.00%"),
    ],
)
def test_ratios_are_integer_arithmetic(numerator: int, denominator: int, ppm: int, text: str) -> None:
    assert ratio_ppm(numerator, denominator) == ppm
    assert percent_text(numerator, denominator) == text
