"""What the serving policy says of one call at its arrival: the class of service it gets (`class_of`), whether its
tenant is within its quotas (`QuotaGate`), and whose prefix cache it may share (`PrefixCachePolicy`). All read only
the book's frozen policy or the replica's flags: O(1), no I/O, on the event loop.

The class of service of a call (billing/policy.py ClassSpec), in domain terms: the name a request asked for
(checked for its size and characters by generate_request.py) and the call's budget give its class, or the
INVALID_ARGUMENT that names why not. A call that names no class gets the least privileged class that accepts
its budget (ServingPolicy.class_for).

Tenants' quotas at admission (billing/policy.py TenantQuota): O(1) per call, no I/O, on the event loop.

Monthly caps (device time, spend) are judged on the month-to-date use the ledger held at the policy's last read
(book.py, every few seconds): a tenant at its cap is refused until the month resets. Calls per second are
a token bucket per tenant on this replica: `calls_per_s` tokens at most, refilled at `calls_per_s` a second.

The prefix cache keys every cached KV block by a salt (sched/blocks.py). A cache shared across tenants is a timing
side channel: a call that comes back fast has learnt that some other call began with the same tokens, so a tenant
could probe what another tenant's prompts start with. So each tenant's calls get a salt of their own, and share
cached blocks only among themselves, unless the operator opts tenants or classes of service into one shared cache
(`zeroqueue serve --shared-prefix-cache`), accepting that risk among them. `--no-prefix-cache` turns caching off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from billing.policy import DEVICE_CAP, RATE_CAP, ClassSpec, ServingPolicy, TenantQuota
from services import errors
from services.errors import clip

from ..call import BudgetSource

MAX_LISTED = 8  # classes a refusal lists with their ranges; one more says how many were left out


def _ranges(policy: ServingPolicy) -> str:
    listed = [f"{c.name} ({c.min_budget_ms}-{c.max_budget_ms} ms)" for c in policy.classes[:MAX_LISTED]]
    more = len(policy.classes) - MAX_LISTED
    return ", ".join(listed) + (f" and {more} more" if more > 0 else "")


def _budget_said(budget_ms: int, source: BudgetSource) -> str:
    if source is BudgetSource.SERVER_DEFAULT:
        return f"{budget_ms} ms (the server's default: the call set no deadline)"
    return f"{budget_ms} ms (its deadline)"


def class_of(policy: ServingPolicy, requested: str, budget_ms: int, source: BudgetSource) -> ClassSpec:
    """The call's class: the one it names if that accepts `budget_ms`, else the one the budget gives; raises
    errors.ServiceClassRefused naming service_class (or deadline, when no class is named)."""
    if requested:
        spec = policy.class_named(requested)
        if spec is None:
            raise errors.ServiceClassRefused(
                "service_class",
                f"unknown class {clip(requested)!r}; this replica offers {_ranges(policy)}",
                "UNKNOWN_SERVICE_CLASS",
                {"service_class": clip(requested)},
            )
        if not spec.accepts(budget_ms):
            raise errors.ServiceClassRefused(
                "service_class",
                f"class {spec.name!r} accepts budgets of {spec.min_budget_ms} to {spec.max_budget_ms} ms; this "
                f"call's budget is {_budget_said(budget_ms, source)}",
                "BUDGET_OUTSIDE_CLASS",
                {
                    "service_class": spec.name,
                    "min_budget_ms": str(spec.min_budget_ms),
                    "max_budget_ms": str(spec.max_budget_ms),
                    "budget_ms": str(budget_ms),
                },
            )
        return spec
    spec = policy.class_for(budget_ms)
    if spec is None:
        raise errors.ServiceClassRefused(
            "deadline",
            f"no class of service accepts a budget of {_budget_said(budget_ms, source)}; the classes: "
            f"{_ranges(policy)}",
            "NO_CLASS_FOR_BUDGET",
            {"budget_ms": str(budget_ms)},
        )
    return spec


NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at_ns: int


class Book(Protocol):
    """What holds the policy in force: PolicyBook (book.py), or a test's fixed policy."""

    policy: ServingPolicy


class QuotaGate:
    """`book.policy` is the policy in force (the book's latest, read as an attribute: nothing is called);
    `wall_us()` the epoch clock monthly resets are on."""

    def __init__(self, book: Book, wall_us: Callable[[], int] = lambda: time.time_ns() // 1000) -> None:
        self.book, self.wall_us = book, wall_us
        self._buckets: dict[str, _Bucket] = {}  # only tenants with a calls_per_s cap

    def check(self, tenant: str, now_ns: int, budget_ns: int) -> None:
        """Raises errors.QuotaExceeded if the tenant may not make a call now; takes one of its calls otherwise."""
        quota = self.book.policy.quota_of(tenant)
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


CLASS_PREFIX = "class:"  # a --shared-prefix-cache entry naming a class of service, not a tenant
SHARED_SALT = b"shared"


@dataclass(frozen=True)
class PrefixCachePolicy:
    enabled: bool = True
    shared: frozenset[str] = frozenset()  # tenant names, and class names as "class:NAME", in one shared cache

    def salt(self, tenant: str, klass: str) -> bytes | None:
        """The salt of a call of `tenant` in class `klass`; None: it neither reads nor fills the cache."""
        if not self.enabled:
            return None
        if tenant in self.shared or CLASS_PREFIX + klass in self.shared:
            return SHARED_SALT
        return b"tenant:" + tenant.encode()
