"""The serving policy as the ledger holds it now: what GetServingPolicy sends and a replica enforces.

- every class of service;
- the price version in force at ``now_us`` of each model, unit and class ('' the generic one);
- for each tenant with a tenant_policies row: its weight and caps, and its use of the current UTC month (the
  month of ``now_us``): ``used_device_us`` is SUM(unit_us) of its usage records finished in the month, and
  ``spent_micros`` (for tenants with a spend cap; 0 for the others) what its invoice for the month would total
  if drafted now (billing/aggregate.py, the very
  aggregation invoices use: per model, unit, class and price version, rounded once, SLA credits deducted).

Each call is one usage record (call_id is unique in the ledger), so a record shipped twice, by two replicas
or by one replica's outbox after a lost acknowledgement, counts once. Usage of a model without a price in force
is left out of ``spent_micros`` (its invoice cannot be drafted either: MissingPrice) rather than withholding
every tenant's policy; its device time still counts in ``used_device_us``.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.aggregate import aggregate_usage, exact_sum, joined
from billing.models import Tenant, TenantPolicy, UsageRow
from billing.period import period_of
from billing.policy import PriceQuote, ServingPolicy, TenantQuota
from billing.pricing import PriceSchedule
from billing.service_classes import list_classes


def _prices(schedule: PriceSchedule, now_us: int) -> tuple[PriceQuote, ...]:
    return tuple(
        PriceQuote(v.model, v.unit, v.service_class, v.price_micros, v.currency) for v in schedule.in_force(now_us)
    )


def _used_device_us(session: Session, tenant_ids: list[int], start_us: int, end_us: int) -> dict[int, int]:
    """SUM(unit_us) per tenant of usage finished in [start_us, end_us): one grouped query."""
    if not tenant_ids:
        return {}
    rows = session.execute(
        select(UsageRow.tenant_id, *exact_sum(UsageRow.unit_us))
        .where(
            UsageRow.finished_at_us >= start_us, UsageRow.finished_at_us < end_us, UsageRow.tenant_id.in_(tenant_ids)
        )
        .group_by(UsageRow.tenant_id)
    )
    return {tenant_id: joined(high, low) for tenant_id, high, low in rows}


def _spent_micros(session: Session, tenant_ids: list[int], start_us: int, end_us: int, schedule: PriceSchedule):
    """Per tenant id: what its invoice for [start_us, end_us) would total now. Only tenants with a spend cap are
    priced, each over its own rows (the index on tenant_id, finished_at_us), so a poll never reads the whole
    month of every tenant."""
    spent: dict[int, int] = {}
    for tenant_id in tenant_ids:
        aggregates = aggregate_usage(
            session, start_us, end_us, tenant_id=tenant_id, schedule=schedule, skip_unpriced=True
        )
        spent[tenant_id] = sum(agg.net_micros for agg in aggregates)
    return spent


def read_serving_policy(session: Session, now_us: int) -> ServingPolicy:
    """The classes, the prices in force at ``now_us`` and every tenant policy with its use of the month of
    ``now_us``. Reads only; the caller's unit of work ends the transaction."""
    month = period_of(now_us)
    schedule = PriceSchedule.load(session, max(month.end_us, now_us + 1))
    policies = session.execute(
        select(TenantPolicy, Tenant.name).join(Tenant, Tenant.id == TenantPolicy.tenant_id).order_by(Tenant.name)
    ).all()
    used = _used_device_us(session, [row.tenant_id for row, _ in policies], month.start_us, month.end_us)
    capped = [row.tenant_id for row, _ in policies if row.spend_micros_per_month is not None]
    spent = _spent_micros(session, capped, month.start_us, month.end_us, schedule)
    tenants = {
        name: TenantQuota(
            tenant=name,
            weight=row.weight,
            device_us_per_month=row.device_us_per_month,
            spend_micros_per_month=row.spend_micros_per_month,
            calls_per_s=row.calls_per_s,
            used_device_us=used.get(row.tenant_id, 0),
            spent_micros=spent.get(row.tenant_id, 0),
            resets_at_us=month.end_us,
        )
        for row, name in policies
    }
    return ServingPolicy(
        classes=tuple(list_classes(session)), prices=_prices(schedule, now_us), tenants=tenants, read_at_us=now_us
    )
