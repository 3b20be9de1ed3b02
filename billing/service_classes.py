"""Classes of service and tenant policies: what the operator decides and a replica enforces (migration 0005).

A class has a name (1..32 characters of [a-z0-9_-]), the range of call budgets it accepts, a priority under
overload (0..100, higher first) and its credit rule: the share of a missed call's charge credited, in parts per
million. A class is never deleted and its name and credit rule never change (the database refuses both): they
decide money already billed, so a new rule is a new class. Its budgets and priority may change.

A tenant's policy is its weight in fair share (1..1000) and optional caps: device time per UTC month (unit·µs,
the unit of usage_records.unit_us), spend per UTC month (micro-units of the invoice's currency) and calls per
second. A tenant without a policy row has weight 1 and no caps. None clears a cap; :data:`KEEP` leaves it.

Nothing here commits: the caller's unit of work does (billing/db.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Final

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.bulk import dialect_insert
from billing.errors import ClassExists, ClassRuleFixed, InvalidClass, InvalidPolicy, UnknownClass
from billing.ledger import tenant_ids
from billing.models import MAX_CLASS_BUDGET_MS, MAX_PRIORITY, MAX_WEIGHT, PPM, ServiceClass, TenantPolicy
from billing.period import now_us as clock_us
from billing.policy import DEVICE_CAP, RATE_CAP, SPEND_CAP, ClassSpec
from billing.records import MAX_INT32, MAX_INT64, check_class_name

CAPS = (DEVICE_CAP, SPEND_CAP, RATE_CAP)


class _Keep(Enum):
    KEEP = "keep"


KEEP: Final = _Keep.KEEP  # a cap argument left as it is (None clears it)


def _check_int(error: type[InvalidClass] | type[InvalidPolicy], name: str, value: object, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise error(f"{name} must be an integer in [{low}, {high}], got {value!r}", field=name)
    return value


def _spec(row: ServiceClass) -> ClassSpec:
    return ClassSpec(row.name, row.min_budget_ms, row.max_budget_ms, row.priority, row.credit_ppm)


def _check_budgets(min_budget_ms: int, max_budget_ms: int) -> None:
    _check_int(InvalidClass, "min_budget_ms", min_budget_ms, 1, MAX_CLASS_BUDGET_MS)
    _check_int(InvalidClass, "max_budget_ms", max_budget_ms, 1, MAX_CLASS_BUDGET_MS)
    if max_budget_ms < min_budget_ms:
        raise InvalidClass(
            f"max_budget_ms ({max_budget_ms}) must not be below min_budget_ms ({min_budget_ms})", field="max_budget_ms"
        )


def _row(session: Session, name: str, *, lock: bool = False) -> ServiceClass:
    check_class_name("name", name, InvalidClass)
    query = select(ServiceClass).where(ServiceClass.name == name)
    row = session.scalars(query.with_for_update() if lock else query).first()
    if row is None:
        raise UnknownClass(name, field="name")
    return row


def add_class(
    session: Session,
    name: str,
    *,
    min_budget_ms: int = 1,
    max_budget_ms: int = MAX_CLASS_BUDGET_MS,
    priority: int = 0,
    credit_ppm: int,
    now_us: int | None = None,
) -> ClassSpec:
    """Add a class; its name and ``credit_ppm`` (0..1,000,000 of a missed call's charge credited) are final."""
    check_class_name("name", name, InvalidClass)
    _check_budgets(min_budget_ms, max_budget_ms)
    _check_int(InvalidClass, "priority", priority, 0, MAX_PRIORITY)
    _check_int(InvalidClass, "credit_ppm", credit_ppm, 0, PPM)
    if session.scalar(select(ServiceClass.id).where(ServiceClass.name == name)) is not None:
        raise ClassExists(name)
    row = ServiceClass(
        name=name,
        min_budget_ms=min_budget_ms,
        max_budget_ms=max_budget_ms,
        priority=priority,
        credit_ppm=credit_ppm,
        created_at_us=clock_us() if now_us is None else now_us,
    )
    session.add(row)
    session.flush()
    return _spec(row)


def update_class(
    session: Session,
    name: str,
    *,
    min_budget_ms: int | None = None,
    max_budget_ms: int | None = None,
    priority: int | None = None,
    credit_ppm: int | None = None,
) -> ClassSpec:
    """Change a class's budgets or priority (None: as it is). A ``credit_ppm`` other than the class's own is
    ClassRuleFixed: the credit rule never changes."""
    row = _row(session, name, lock=True)
    if credit_ppm is not None and credit_ppm != row.credit_ppm:
        raise ClassRuleFixed(
            f"credit_ppm: class {name!r} credits {row.credit_ppm} ppm for good (it decides money already billed); "
            "add a new class for another rule",
            field="credit_ppm",
        )
    low = row.min_budget_ms if min_budget_ms is None else min_budget_ms
    high = row.max_budget_ms if max_budget_ms is None else max_budget_ms
    _check_budgets(low, high)
    if priority is not None:
        row.priority = _check_int(InvalidClass, "priority", priority, 0, MAX_PRIORITY)
    row.min_budget_ms, row.max_budget_ms = low, high
    session.flush()
    return _spec(row)


def get_class(session: Session, name: str) -> ClassSpec:
    return _spec(_row(session, name))


def list_classes(session: Session) -> list[ClassSpec]:
    """Every class, by name (`standard` among them)."""
    return [_spec(row) for row in session.scalars(select(ServiceClass).order_by(ServiceClass.name))]


# --- tenant policies ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TenantPolicyView:
    tenant: str
    weight: int = 1
    device_us_per_month: int | None = None
    spend_micros_per_month: int | None = None
    calls_per_s: int | None = None
    updated_at_us: int | None = None  # None: the tenant has no policy row (weight 1, no caps)


_CAP_BOUNDS = {DEVICE_CAP: MAX_INT64, SPEND_CAP: MAX_INT64, RATE_CAP: MAX_INT32}


def _view(tenant: str, row: TenantPolicy | None) -> TenantPolicyView:
    if row is None:
        return TenantPolicyView(tenant)
    return TenantPolicyView(
        tenant, row.weight, row.device_us_per_month, row.spend_micros_per_month, row.calls_per_s, row.updated_at_us
    )


def set_tenant_policy(
    session: Session,
    tenant: str,
    *,
    weight: int | None = None,
    device_us_per_month: int | None | _Keep = KEEP,
    spend_micros_per_month: int | None | _Keep = KEEP,
    calls_per_s: int | None | _Keep = KEEP,
    now_us: int | None = None,
) -> TenantPolicyView:
    """Set a tenant's weight (None: as it is, 1 for a new policy) and caps (KEEP: as they are, None: cleared);
    every cap is a positive integer."""
    tenant_id = tenant_ids(session, {tenant})[tenant]
    if weight is not None:
        _check_int(InvalidPolicy, "weight", weight, 1, MAX_WEIGHT)
    caps = {DEVICE_CAP: device_us_per_month, SPEND_CAP: spend_micros_per_month, RATE_CAP: calls_per_s}
    for name, value in caps.items():
        if value is not KEEP and value is not None:
            _check_int(InvalidPolicy, name, value, 1, _CAP_BOUNDS[name])
    now_us = clock_us() if now_us is None else now_us
    session.execute(  # the row, made once even by two first settings at the same time; then locked and changed
        dialect_insert(session, TenantPolicy.__table__)
        .values(tenant_id=tenant_id, weight=1, updated_at_us=now_us)
        .on_conflict_do_nothing(index_elements=["tenant_id"])
    )
    row = session.scalars(
        select(TenantPolicy)
        .where(TenantPolicy.tenant_id == tenant_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).one()
    if weight is not None:
        row.weight = weight
    for name, value in caps.items():
        if value is not KEEP:
            setattr(row, name, value)
    row.updated_at_us = now_us
    session.flush()
    return _view(tenant, row)


def show_tenant_policy(session: Session, tenant: str) -> TenantPolicyView:
    """The tenant's policy; weight 1 and no caps for a tenant without one."""
    tenant_id = tenant_ids(session, {tenant})[tenant]
    return _view(tenant, session.get(TenantPolicy, tenant_id))
