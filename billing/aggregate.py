"""Usage aggregated per group, model, unit, class of service and price version: the input of invoices,
chargeback and the serving policy's month-to-date spend.

The period is split at every price change, each piece is aggregated in SQL
(SUMs over integer columns), and pieces that share a price version are
merged, so usage is summed first and priced (rounded) once per aggregate.

Why no sum can overflow.  A SQL SUM over BIGINTs overflows at 2^63 (SQLite
raises "integer overflow", PostgreSQL's cast back to BIGINT "out of range"),
and a month may hold any number of records, so each summed column is summed
in two halves: SUM(v / 2^29) and SUM(v % 2^29), joined here with Python's
unbounded integers.  Every summed value is below 2^58 (billing/records.py:
unit_us ≤ num_units × 31 days < 2^54, tokens < 2^31, idle wall time ≤ a
minute × num_units < 2^38; the database CHECKs the same), so each half is
below 2^29 per row and a SUM of n rows is below n × 2^29: exact for up to
2^34 (17 billion) records in one aggregate and month, ~6,400 records a
second for the whole month into one group, a table of several TB.  The
joined totals are exact; what is stored or sent must fit a signed 64-bit
integer, which :func:`check_int64` asks before anything is written (a
refusal names the period, never an overflow in the database).

SLA credit per class.  Calls that missed their deadline are credited the
class's credit_ppm share of their cost, rounded ONCE, half up, in integers:

    credit_micros = round_half_up(missed_unit_us × price_micros × credit_ppm / 10^12)

With credit_ppm = 10^6 (the class `standard`, and the rule before classes)
this is exactly cost_micros(missed_unit_us, price_micros), so invoices made
before classes are unchanged.  A credit never exceeds the charge.  A usage
row naming a class the ledger does not know (a replica's newer
configuration) is credited 100 %, the rule before classes: the tenant is
never credited less than it would have been.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from sqlalchemy import BigInteger, ColumnElement, Select, case, cast, func, select
from sqlalchemy.orm import Session

from billing.errors import AmountOutOfRange, MissingPrice
from billing.models import PPM, ServiceClass, Tenant, UsageRow
from billing.period import US_PER_DAY
from billing.pricing import US_PER_SECOND, PriceSchedule, PriceVersion, cost_micros
from billing.records import DEFAULT_CLASS, MAX_INT64

log = structlog.get_logger(__name__)
SPLIT = 1 << 29
# the usage columns summed per aggregate, each also over the missed requests alone (missed_<name>)
SUMMED = ("unit_us", "prompt_tokens", "completion_tokens", "cached_prompt_tokens")


@dataclass(slots=True)
class UsageAggregate:
    """Usage of one group and class of service under one price version; ``missed_*`` are the requests that
    missed their deadline, credited ``credit_ppm`` per million of their cost (the class's rule).

    [from_us, to_us) is where that price version was in force for the class within the aggregated range.
    """

    key: tuple[object, ...]
    model: str
    unit: str
    price: PriceVersion
    from_us: int
    to_us: int
    service_class: str = DEFAULT_CLASS
    credit_ppm: int = PPM
    num_requests: int = 0
    unit_us: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_missed: int = 0
    missed_unit_us: int = 0
    missed_prompt_tokens: int = 0
    missed_completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # of prompt_tokens, those the prefix cache served: shown, never priced
    missed_cached_prompt_tokens: int = 0

    @property
    def charge_micros(self) -> int:
        return cost_micros(self.unit_us, self.price.price_micros)

    @property
    def sla_credit_micros(self) -> int:
        """The (positive) credit for requests that missed their deadline: the class's share of their cost,
        rounded once, half up (see the module's comment)."""
        return credit_micros(self.missed_unit_us, self.price.price_micros, self.credit_ppm)

    @property
    def net_micros(self) -> int:
        return self.charge_micros - self.sla_credit_micros


def credit_micros(unit_us: int, price_micros: int, credit_ppm: int) -> int:
    """``unit_us × price_micros × credit_ppm / 10^12`` rounded half up, in integers (all ≥ 0); at PPM the same
    integer as cost_micros(unit_us, price_micros), whose rounding it scales."""
    if credit_ppm < 0 or credit_ppm > PPM:
        raise ValueError(f"credit_ppm must be in [0, {PPM}], got {credit_ppm}")
    scale = US_PER_SECOND * PPM
    return (unit_us * price_micros * credit_ppm + scale // 2) // scale


def class_credits(session: Session) -> dict[str, int]:
    """Each known class's credit_ppm (a class the ledger does not know is credited :data:`PPM`)."""
    return {name: ppm for name, ppm in session.execute(select(ServiceClass.name, ServiceClass.credit_ppm))}


def check_int64(name: str, value: int, where: str) -> int:
    """``value`` if a signed 64-bit column can hold it; AmountOutOfRange naming ``where`` otherwise."""
    if not -MAX_INT64 - 1 <= value <= MAX_INT64:
        raise AmountOutOfRange(
            f"period: the {name} of {where} ({value}) exceeds what the ledger stores "
            "(2^63-1); split the usage over more price versions or check the price",
            field="period",
        )
    return value


def _sum(column: ColumnElement[int]) -> ColumnElement[int]:
    # PostgreSQL's SUM(bigint) is numeric; cast back so Python sees int, never Decimal.
    return cast(func.coalesce(func.sum(column), 0), BigInteger)


def exact_sum(column: ColumnElement[int]) -> list[ColumnElement[int]]:
    """SUM(column) of non-negative values below 2^58 as two SQL sums that cannot overflow; join them with
    :func:`joined` (see the module's comment)."""
    return [_sum(column // SPLIT), _sum(column % SPLIT)]


def joined(high: int, low: int) -> int:
    return high * SPLIT + low


def _missed(column: ColumnElement[int]) -> list[ColumnElement[int]]:
    return exact_sum(case((UsageRow.deadline_met, 0), else_=column))


def group_column(name: str, period_start_us: int) -> ColumnElement[object]:
    """The SQL expression behind a chargeback grouping."""
    columns: dict[str, ColumnElement[object]] = {
        "cost_center": UsageRow.cost_center,
        "team": UsageRow.team,
        "model": UsageRow.model,
        "tenant": Tenant.name,
        "service_class": UsageRow.service_class,
        "request_kind": UsageRow.request_kind,
        "door": UsageRow.door,
        "weight_dtype": UsageRow.weight_dtype,
        "day": (UsageRow.finished_at_us - period_start_us) // US_PER_DAY,
    }
    return columns[name].label(f"g_{name}")


def aggregate_usage(
    session: Session,
    start_us: int,
    end_us: int,
    *,
    group_by: Sequence[str] = (),
    tenant_id: int | None = None,
    schedule: PriceSchedule | None = None,
    skip_unpriced: bool = False,
) -> list[UsageAggregate]:
    """Aggregate usage finished in [start_us, end_us) per group, model, unit, class and price version.

    Usage without a price in force raises MissingPrice, or with ``skip_unpriced`` is left out."""
    schedule = schedule or PriceSchedule.load(session, end_us)
    credits = class_credits(session)
    groups = [group_column(name, start_us) for name in group_by]
    merged: dict[tuple[object, ...], UsageAggregate] = {}
    for piece_start, piece_end in itertools.pairwise(schedule.boundaries(start_us, end_us)):
        for row in session.execute(_piece_query(groups, group_by, piece_start, piece_end, tenant_id)):
            key, (model, unit, service_class, *sums) = tuple(row[: len(groups)]), row[len(groups) :]
            try:
                price = schedule.version_at(model, unit, piece_start, service_class)
            except MissingPrice:
                if skip_unpriced:
                    continue
                raise
            aggregate = merged.get((key, model, unit, service_class, price.id))
            if aggregate is None:
                if service_class not in credits:
                    log.warning("billing.unknown_class", service_class=service_class, credited="100 %", model=model)
                until = schedule.valid_until(price, service_class)
                aggregate = merged[(key, model, unit, service_class, price.id)] = UsageAggregate(
                    key,
                    model,
                    unit,
                    price,
                    max(start_us, price.effective_from_us),
                    end_us if until is None else min(end_us, until),
                    service_class,
                    credits.get(service_class, PPM),
                )
            _accumulate(aggregate, sums)
    return list(merged.values())


def _piece_query(
    groups: list[ColumnElement[object]], group_by: Sequence[str], start_us: int, end_us: int, tenant_id: int | None
) -> Select[tuple[object, ...]]:
    query = (
        select(
            *groups,
            UsageRow.model,
            UsageRow.unit,
            UsageRow.service_class,
            func.count().label("num_requests"),
            *(half for name in SUMMED for half in exact_sum(getattr(UsageRow, name))),
            _sum(case((UsageRow.deadline_met, 0), else_=1)),
            *(half for name in SUMMED for half in _missed(getattr(UsageRow, name))),
        )
        .where(UsageRow.finished_at_us >= start_us, UsageRow.finished_at_us < end_us)
        .group_by(*groups, UsageRow.model, UsageRow.unit, UsageRow.service_class)
    )
    if "tenant" in group_by:
        query = query.join(Tenant, Tenant.id == UsageRow.tenant_id)
    if tenant_id is not None:
        query = query.where(UsageRow.tenant_id == tenant_id)
    return query


def _accumulate(aggregate: UsageAggregate, sums: Sequence[int]) -> None:
    """Adds one row of _piece_query: the request count, each SUMMED column's two halves, the missed count, and each
    SUMMED column's two halves over the missed requests."""
    halves = 2 * len(SUMMED)
    usage, num_missed, missed = sums[1 : 1 + halves], sums[1 + halves], sums[2 + halves :]
    aggregate.num_requests += sums[0]
    aggregate.num_missed += num_missed
    for index, name in enumerate(SUMMED):
        setattr(aggregate, name, getattr(aggregate, name) + joined(*usage[2 * index : 2 * index + 2]))
        missed_name = f"missed_{name}"
        setattr(aggregate, missed_name, getattr(aggregate, missed_name) + joined(*missed[2 * index : 2 * index + 2]))
