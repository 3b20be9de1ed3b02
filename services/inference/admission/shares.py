"""Each tenant's fair share of the replica's slots, and who may borrow what others leave unused. No torch.

A tenant is active while it has calls running or has sent calls lately (age-weighted, half-life
`half_life_s`). Each active tenant's share is the slots × its weight / the active tenants' weights. A tenant may
hold more than its share (capacity another leaves unused is lent), but a slot it borrows must not be one of the last
free ones some other active tenant under its share would find: each of those keeps `per_tenant` free slots in
hand, so a modest tenant's next call finds room at once rather than behind a flood. Running calls are never
pushed out; the lent slots come back as the borrower's calls finish, which on a replica of many slots is every few
tens of ms.

The work per decision is O(active tenants), at most one per slot plus those seen in the last seconds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

NS_PER_S = 1_000_000_000


@dataclass
class Shares:
    num_slots: int
    weights: Mapping[str, float] = field(default_factory=dict)  # tenant -> weight; 1 for a tenant not named
    half_life_s: float = 2.0
    per_tenant: int = 3  # free slots kept for each tenant under its share: its calls come in bursts
    active_weight: float = 0.25  # age-weighted arrivals below which a tenant with nothing running is idle
    used: Counter[str] = field(default_factory=Counter)  # slots held by admitted calls, by tenant
    _recent: dict[str, tuple[float, int]] = field(default_factory=dict)  # tenant -> (arrivals, as of ns)

    def arrive(self, tenant: str, now_ns: int) -> None:
        self._recent[tenant] = (self._recency(tenant, now_ns) + 1.0, now_ns)

    def admit(self, tenant: str) -> None:
        self.used[tenant] += 1

    def release(self, tenant: str) -> None:
        self.used[tenant] -= 1
        if self.used[tenant] <= 0:
            del self.used[tenant]

    def share(self, tenant: str, now_ns: int) -> float:
        """The slots `tenant` is guaranteed now: its weight's part of the active tenants' (itself included)."""
        active = self._active(now_ns) | {tenant}
        return self._slots_per_weight(active) * self.weights.get(tenant, 1.0)

    def kept_free(self, tenant: str, now_ns: int) -> int:
        """Free slots that `tenant`, holding its share or more, may not take: `per_tenant` for each other active
        tenant under its own share. 0 for a tenant under its share, which takes any free slot."""
        others, per_weight = self._others(tenant, now_ns)
        if not others or self._under(tenant, per_weight):
            return 0
        return self.per_tenant * sum(1 for t in others if self._under(t, per_weight))

    def lent_to_others(self, tenant: str, now_ns: int) -> bool:
        """`tenant` holds less than its share while another active tenant holds more than its own: slots of
        `tenant`'s share are lent out."""
        others, per_weight = self._others(tenant, now_ns)
        if not others or not self._under(tenant, per_weight):
            return False
        return any(self.used[t] > per_weight * self.weights.get(t, 1.0) for t in others)

    def _others(self, tenant: str, now_ns: int) -> tuple[list[str], float]:
        """The other active tenants, and the slots per unit of weight with `tenant` counted among the active."""
        active = self._active(now_ns) | {tenant}
        return [t for t in active if t != tenant], self._slots_per_weight(active)

    def _slots_per_weight(self, active: set[str]) -> float:
        return self.num_slots / sum(self.weights.get(t, 1.0) for t in active)

    def _under(self, tenant: str, per_weight: float) -> bool:
        """One more call of `tenant` would still be inside its share."""
        return self.used[tenant] + 1 <= per_weight * self.weights.get(tenant, 1.0)

    def _active(self, now_ns: int) -> set[str]:
        for t in [t for t in self._recent if t not in self.used and self._recency(t, now_ns) < self.active_weight]:
            del self._recent[t]  # idle: forgotten, so the set stays as small as the tenants really sending
        return set(self._recent) | set(self.used)

    def _recency(self, tenant: str, now_ns: int) -> float:
        weight, as_of_ns = self._recent.get(tenant, (0.0, now_ns))
        return weight * 0.5 ** (max(now_ns - as_of_ns, 0) / NS_PER_S / self.half_life_s)
