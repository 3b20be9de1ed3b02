"""billing.policy.ServingPolicy ⇄ metering.v1.ServingPolicy: what GetServingPolicy sends and a replica reads.

No database here: a replica imports :func:`policy_from_proto` without the ledger. Reading is lenient where the
wire's defaults mean "before this existed": no classes is the one class `standard` (the rule before classes), a
tenant's weight 0 is weight 1. Unset optional caps are None (no cap).

:class:`SharedRead` lets the metering service answer every replica's poll within a second from one ledger read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from zeroqueue.metering.v1 import metering_pb2 as pb

from billing.policy import STANDARD, ClassSpec, PriceQuote, ServingPolicy, TenantQuota


def policy_to_proto(policy: ServingPolicy) -> pb.ServingPolicy:
    return pb.ServingPolicy(
        classes=[
            pb.ServiceClass(
                name=spec.name,
                min_budget_ms=spec.min_budget_ms,
                max_budget_ms=spec.max_budget_ms,
                priority=spec.priority,
                credit_ppm=spec.credit_ppm,
            )
            for spec in policy.classes
        ],
        prices=[
            pb.ClassPrice(
                model=quote.model,
                unit=quote.unit,
                service_class=quote.service_class,
                price_micros=quote.price_micros,
                currency=quote.currency,
            )
            for quote in policy.prices
        ],
        tenants=[_quota_to_proto(quota) for _, quota in sorted(policy.tenants.items())],
        read_at_us=policy.read_at_us,
    )


def _quota_to_proto(quota: TenantQuota) -> pb.TenantQuota:
    message = pb.TenantQuota(
        tenant=quota.tenant,
        weight=quota.weight,
        used_device_us=quota.used_device_us,
        spent_micros=quota.spent_micros,
        resets_at_us=quota.resets_at_us,
    )
    for cap in ("device_us_per_month", "spend_micros_per_month", "calls_per_s"):
        value = getattr(quota, cap)
        if value is not None:
            setattr(message, cap, value)
    return message


def _cap(message: pb.TenantQuota, name: str) -> int | None:
    return getattr(message, name) if message.HasField(name) else None


def policy_from_proto(message: pb.ServingPolicy) -> ServingPolicy:
    classes = tuple(
        ClassSpec(c.name, c.min_budget_ms, c.max_budget_ms, c.priority, c.credit_ppm) for c in message.classes
    )
    return ServingPolicy(
        classes=classes or (STANDARD,),
        prices=tuple(PriceQuote(p.model, p.unit, p.service_class, p.price_micros, p.currency) for p in message.prices),
        tenants={
            t.tenant: TenantQuota(
                tenant=t.tenant,
                weight=t.weight or 1,
                device_us_per_month=_cap(t, "device_us_per_month"),
                spend_micros_per_month=_cap(t, "spend_micros_per_month"),
                calls_per_s=_cap(t, "calls_per_s"),
                used_device_us=t.used_device_us,
                spent_micros=t.spent_micros,
                resets_at_us=t.resets_at_us,
            )
            for t in message.tenants
        },
        read_at_us=message.read_at_us,
    )


class SharedRead:
    """The latest result of ``read``, read again once older than ``max_age_s``: replicas poll GetServingPolicy
    every few seconds each, and the month-to-date sums behind it need not be computed once per poll. Calls that
    arrive during a read wait for it; a failed read is not kept (the next call reads again)."""

    def __init__(
        self,
        read: Callable[[], Awaitable[pb.ServingPolicy]],
        *,
        max_age_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read, self._max_age_s, self._clock = read, max_age_s, clock
        self._lock = asyncio.Lock()
        self._value: pb.ServingPolicy | None = None
        self._read_at = 0.0

    async def get(self) -> pb.ServingPolicy:
        async with self._lock:
            if self._value is None or self._clock() - self._read_at > self._max_age_s:
                self._value = await self._read()
                self._read_at = self._clock()
            return self._value
