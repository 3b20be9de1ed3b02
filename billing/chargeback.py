"""Chargeback: usage, cost and deadline attainment per cost center, team, model, tenant, day, class of
service, request kind (plain, chat, constrained, chat_constrained), door (grpc, http) or weight dtype (int8 for a
quantized replica, else the checkpoint's: bfloat16, float32, ...; "(none)" when unknown), plus device utilisation
from the idle records.

Each row also shows, of its prompt tokens, those the prefix cache served (cached_prompt_tokens): a call that hit the
cache measured less device time and costs less by that alone; the count prices nothing.

Cost is the billed amount after SLA credits, priced like invoice lines: usage
is summed per group, model, unit, class and price version (each class at its
own price and credit rule) and rounded once there, then summed per row.  Grouping finer than invoices (e.g. by day) can
therefore differ from invoice totals by the rounding of the extra splits,
at most half a micro-unit per aggregate.  Rows never mix units: SM·µs and
core·µs are reported on separate rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from billing.aggregate import aggregate_usage, check_int64, exact_sum, joined
from billing.errors import InvalidArgument
from billing.ledger import tenant_ids
from billing.models import IdleRow, UsageRow
from billing.period import US_PER_DAY, day_label, parse_period
from billing.period import now_us as clock_us

GROUPINGS = ("cost_center", "team", "model", "tenant", "day", "service_class", "request_kind", "door", "weight_dtype")
NO_LABEL = "(none)"


def ratio_ppm(numerator: int, denominator: int) -> int:
    """numerator / denominator in parts per million, rounded half up; 0 when the denominator is 0."""
    if denominator <= 0:
        return 0
    return (2 * numerator * 1_000_000 + denominator) // (2 * denominator)


def percent_text(numerator: int, denominator: int) -> str:
    """A display ratio with two decimals, computed with integers ('—' when undefined)."""
    if denominator <= 0:
        return "—"
    hundredths = (2 * numerator * 10_000 + denominator) // (2 * denominator)
    return f"{hundredths // 100}.{hundredths % 100:02d}%"


@dataclass(frozen=True, slots=True)
class ChargebackRow:
    group: tuple[tuple[str, str], ...]
    unit: str
    currency: str
    num_requests: int
    num_deadline_met: int
    unit_us: int
    prompt_tokens: int
    cached_prompt_tokens: int  # of prompt_tokens, those the prefix cache served
    completion_tokens: int
    cost_micros: int

    @property
    def num_admitted(self) -> int:
        return self.num_requests

    @property
    def attainment(self) -> str:
        return percent_text(self.num_deadline_met, self.num_admitted)

    @property
    def label(self) -> str:
        return " / ".join(value for _, value in self.group) or "all"


@dataclass(frozen=True, slots=True)
class DeviceUtilisation:
    device_id: str
    unit: str
    num_units: int
    wall_unit_us: int
    idle_unit_us: int
    billed_unit_us: int

    @property
    def busy_unit_us(self) -> int:
        return self.wall_unit_us - self.idle_unit_us

    @property
    def unaccounted_unit_us(self) -> int:
        """wall − idle − billed: zero when every busy µs was billed to some request."""
        return self.wall_unit_us - self.idle_unit_us - self.billed_unit_us

    @property
    def utilisation_ppm(self) -> int:
        return ratio_ppm(self.busy_unit_us, self.wall_unit_us)


@dataclass(frozen=True, slots=True)
class UtilisationPoint:
    day: str
    unit: str
    wall_unit_us: int
    idle_unit_us: int

    @property
    def utilisation_ppm(self) -> int:
        return ratio_ppm(self.wall_unit_us - self.idle_unit_us, self.wall_unit_us)


@dataclass(frozen=True, slots=True)
class ChargebackReport:
    period: str
    group_by: tuple[str, ...]
    tenant: str | None
    rows: tuple[ChargebackRow, ...]
    devices: tuple[DeviceUtilisation, ...]
    timeline: tuple[UtilisationPoint, ...]
    generated_at_us: int


def _check_groupings(by: Sequence[str]) -> tuple[str, ...]:
    if isinstance(by, str):
        by = [part for part in by.split(",") if part]
    for name in by:
        if name not in GROUPINGS:
            raise InvalidArgument(f"by: {name!r} is not one of {', '.join(GROUPINGS)}", field="by")
    if len(set(by)) != len(by):
        raise InvalidArgument("by: a grouping is repeated", field="by")
    return tuple(by)


def chargeback_report(
    session: Session, period: str, by: Sequence[str], *, tenant: str | None = None, now_us: int | None = None
) -> ChargebackReport:
    """The chargeback report for ``period`` grouped by ``by`` (any of :data:`GROUPINGS`).

    With ``tenant`` the usage is that tenant's only and device utilisation,
    which is shared infrastructure, is left out.
    """
    group_by = _check_groupings(by)
    bounds = parse_period(period)
    tenant_id = tenant_ids(session, {tenant})[tenant] if tenant is not None else None
    aggregates = aggregate_usage(session, bounds.start_us, bounds.end_us, group_by=group_by, tenant_id=tenant_id)
    totals: dict[tuple[object, ...], list[int]] = {}
    for agg in aggregates:
        key = (
            *[_text(name, value, bounds.start_us) for name, value in zip(group_by, agg.key, strict=True)],
            agg.unit,
            agg.price.currency,
        )
        sums = totals.setdefault(key, [0] * 7)
        for index, value in enumerate(
            (
                agg.num_requests,
                agg.num_requests - agg.num_missed,
                agg.unit_us,
                agg.prompt_tokens,
                agg.cached_prompt_tokens,
                agg.completion_tokens,
                agg.net_micros,
            )
        ):
            sums[index] += value
    names = ("requests", "requests", "unit·µs", "prompt tokens", "cached prompt tokens", "completion tokens", "cost")
    for key, sums in totals.items():
        for name, value in zip(names, sums, strict=True):
            check_int64(name, value, f"{' / '.join(map(str, key[:-1]))} in {bounds.name}")
    rows = tuple(
        ChargebackRow(tuple(zip(group_by, key[: len(group_by)], strict=True)), key[-2], key[-1], *sums)  # type: ignore[arg-type]
        for key, sums in sorted(totals.items())
    )
    devices, timeline = ((), ()) if tenant is not None else _utilisation(session, bounds.start_us, bounds.end_us)
    return ChargebackReport(period, group_by, tenant, rows, devices, timeline, clock_us() if now_us is None else now_us)


def _text(name: str, value: object, start_us: int) -> str:
    if name == "day":
        return day_label(start_us + int(value) * US_PER_DAY)  # type: ignore[call-overload]
    return NO_LABEL if value is None or value == "" else str(value)  # '': a weight dtype unknown (before 0010)


def _utilisation(
    session: Session, start_us: int, end_us: int
) -> tuple[tuple[DeviceUtilisation, ...], tuple[UtilisationPoint, ...]]:
    in_period = (IdleRow.minute_start_us >= start_us, IdleRow.minute_start_us < end_us)
    where = f"the devices in {day_label(start_us)[:7]}"
    billed = {
        device: check_int64("billed unit·µs", joined(high, low), where)
        for device, high, low in session.execute(
            select(UsageRow.device_id, *exact_sum(UsageRow.unit_us))
            .where(UsageRow.finished_at_us >= start_us, UsageRow.finished_at_us < end_us)
            .group_by(UsageRow.device_id)
        )
    }
    device_rows = session.execute(
        select(
            IdleRow.device_id,
            IdleRow.unit,
            func.max(IdleRow.num_units),
            *exact_sum(IdleRow.wall_unit_us),
            *exact_sum(IdleRow.idle_unit_us),
        )
        .where(*in_period)
        .group_by(IdleRow.device_id, IdleRow.unit)
        .order_by(IdleRow.device_id)
    )
    devices = tuple(
        DeviceUtilisation(
            device,
            unit,
            num_units,
            check_int64("wall unit·µs", joined(wall_high, wall_low), where),
            check_int64("idle unit·µs", joined(idle_high, idle_low), where),
            billed.get(device, 0),
        )
        for device, unit, num_units, wall_high, wall_low, idle_high, idle_low in device_rows
    )
    day = ((IdleRow.minute_start_us - start_us) // US_PER_DAY).label("day")
    points = session.execute(
        select(day, IdleRow.unit, *exact_sum(IdleRow.wall_unit_us), *exact_sum(IdleRow.idle_unit_us))
        .where(*in_period)
        .group_by(day, IdleRow.unit)
        .order_by(day, IdleRow.unit)
    )
    timeline = tuple(
        UtilisationPoint(
            day_label(start_us + index * US_PER_DAY), unit, joined(wall_high, wall_low), joined(idle_high, idle_low)
        )
        for index, unit, wall_high, wall_low, idle_high, idle_low in points
    )
    return devices, timeline
