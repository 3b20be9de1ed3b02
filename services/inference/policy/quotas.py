"""Tenants' quotas at admission (billing/policy.py TenantQuota): O(1) per call, no I/O, on the event loop.

Monthly caps (device time, spend) are judged on the month-to-date use the ledger held at the policy's last read
(book.py, every few seconds): a tenant at its cap is refused until the month resets. Calls per second are
a token bucket per tenant on this replica: `calls_per_s` tokens at most, refilled at `calls_per_s` a second.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from billing.policy import DEVICE_CAP, RATE_CAP, ServingPolicy, TenantQuota
from services import errors

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at_ns: int


class QuotaGate:
    """`policy()` is the policy in force (the book's latest); `wall_us()` the epoch clock monthly resets are on."""

    def __init__(
        self, policy: Callable[[], ServingPolicy], wall_us: Callable[[], int] = lambda: time.time_ns() // 1000
    ) -> None:
        self.policy, self.wall_us = policy, wall_us
        self._buckets: dict[str, _Bucket] = {}  # only tenants with a calls_per_s cap

    def check(self, tenant: str, now_ns: int, budget_ns: int) -> None:
        """Raises errors.QuotaExceeded if the tenant may not make a call now; takes one of its calls otherwise."""
        quota = self.policy().quota_of(tenant)
        if quota is None:
            self._buckets.pop(tenant, None)
            return
        self._check_monthly(tenant, quota, budget_ns)
        if quota.calls_per_s is None:
            self._buckets.pop(tenant, None)
            return
        wait_ns = self._take(tenant, quota.calls_per_s, now_ns)
        if wait_ns:
            limit = quota.calls_per_s
            raise errors.QuotaExceeded(tenant, RATE_CAP, limit, limit, -(-wait_ns // NS_PER_MS), budget_ns // NS_PER_MS)

    def _check_monthly(self, tenant: str, quota: TenantQuota, budget_ns: int) -> None:
        cap = quota.exhausted_cap
        if cap is None:
            return
        now_us = self.wall_us()
        if quota.resets_at_us and now_us >= quota.resets_at_us:
            return  # the month the use was counted in is over; the next read says this month's
        if cap == DEVICE_CAP:
            limit, used = quota.device_us_per_month, quota.used_device_us
        else:
            limit, used = quota.spend_micros_per_month, quota.spent_micros
        retry_after_ms = -(-max(quota.resets_at_us - now_us, 0) // 1000)
        raise errors.QuotaExceeded(tenant, cap, limit, used, retry_after_ms, budget_ns // NS_PER_MS, quota.resets_at_us)

    def _take(self, tenant: str, rate_per_s: int, now_ns: int) -> int:
        """Takes a token from the tenant's bucket: 0 if there was one, else the ns until the next one comes."""
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(float(rate_per_s), now_ns)
        elapsed_ns = max(now_ns - bucket.at_ns, 0)
        bucket.tokens = min(float(rate_per_s), bucket.tokens + elapsed_ns * rate_per_s / NS_PER_S)
        bucket.at_ns = max(bucket.at_ns, now_ns)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0
        return max(int((1.0 - bucket.tokens) * NS_PER_S / rate_per_s), 1)
