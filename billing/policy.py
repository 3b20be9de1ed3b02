"""What a replica enforces from the ledger: classes of service, their prices now, tenants' weights and quotas.

Plain frozen data, no database and no torch: billing/serving_policy.py reads it from the ledger, the metering
service sends it (GetServingPolicy), and a replica keeps the latest copy it has read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from billing.models import DEFAULT_CLASS, MAX_CLASS_BUDGET_MS, PPM
from billing.pricing import GENERIC_PRICE

DEVICE_CAP = "device_us_per_month"
SPEND_CAP = "spend_micros_per_month"
RATE_CAP = "calls_per_s"


@dataclass(frozen=True, slots=True)
class ClassSpec:
    name: str
    min_budget_ms: int
    max_budget_ms: int
    priority: int  # higher is admitted first under overload
    credit_ppm: int  # share of a missed call's charge credited, per million

    def accepts(self, budget_ms: int) -> bool:
        return self.min_budget_ms <= budget_ms <= self.max_budget_ms


STANDARD = ClassSpec(DEFAULT_CLASS, 1, MAX_CLASS_BUDGET_MS, 0, PPM)


@dataclass(frozen=True, slots=True)
class PriceQuote:
    model: str
    unit: str
    service_class: str  # GENERIC_PRICE for every class without its own
    price_micros: int  # per unit·second
    currency: str


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """A tenant's weight and caps, with its month-to-date use as the ledger held it at the policy's read."""

    tenant: str
    weight: int = 1
    device_us_per_month: int | None = None
    spend_micros_per_month: int | None = None
    calls_per_s: int | None = None
    used_device_us: int = 0
    spent_micros: int = 0
    resets_at_us: int = 0  # the start of the next UTC month

    @property
    def exhausted_cap(self) -> str | None:
        """The monthly cap this tenant has reached (DEVICE_CAP or SPEND_CAP), or None."""
        if self.device_us_per_month is not None and self.used_device_us >= self.device_us_per_month:
            return DEVICE_CAP
        if self.spend_micros_per_month is not None and self.spent_micros >= self.spend_micros_per_month:
            return SPEND_CAP
        return None


def _frozen(tenants: Mapping[str, TenantQuota]) -> Mapping[str, TenantQuota]:
    return MappingProxyType(dict(tenants))


@dataclass(frozen=True)
class ServingPolicy:
    classes: tuple[ClassSpec, ...] = (STANDARD,)
    prices: tuple[PriceQuote, ...] = ()
    tenants: Mapping[str, TenantQuota] = field(default_factory=lambda: _frozen({}))
    read_at_us: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenants", _frozen(self.tenants))

    def class_named(self, name: str) -> ClassSpec | None:
        return next((spec for spec in self.classes if spec.name == name), None)

    def class_for(self, budget_ms: int) -> ClassSpec | None:
        """The class of a call that names none: the least privileged class that accepts its budget (lowest
        priority, then the narrowest range, then the name), so that priority is only ever asked for."""
        accepting = [spec for spec in self.classes if spec.accepts(budget_ms)]
        if not accepting:
            return None
        return min(accepting, key=lambda s: (s.priority, s.max_budget_ms - s.min_budget_ms, s.name))

    def price_of(self, model: str, unit: str, service_class: str) -> PriceQuote | None:
        """The price in force of a call of `service_class`: the class's own, else the generic one."""
        generic = None
        for quote in self.prices:
            if quote.model != model or quote.unit != unit:
                continue
            if quote.service_class == service_class:
                return quote
            if quote.service_class == GENERIC_PRICE:
                generic = quote
        return generic

    def weight_of(self, tenant: str) -> int:
        quota = self.tenants.get(tenant)
        return quota.weight if quota is not None else 1

    def quota_of(self, tenant: str) -> TenantQuota | None:
        return self.tenants.get(tenant)
