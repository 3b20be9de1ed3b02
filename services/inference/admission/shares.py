"""Each tenant's fair share of the replica's slots, and who may borrow what others leave unused. No torch.

A tenant is active while it has calls running or has sent calls lately (age-weighted, half-life
`half_life_s`). Each active tenant's share is the slots × its weight / the active tenants' weights.

Max-min fairness on what tenants offer: a tenant is *modest* while what it offers, in slots (its rate of first
attempts lately × how long its calls hold a slot), fits inside its share. A modest tenant is served as if alone:
its bursts may take it past its share for a moment, since on average it holds less. A tenant that offers more
than its share (a flood) borrows what the others leave, but never one of the last free slots a modest tenant, or a
tenant under its share now, would find: each of those keeps `per_tenant` free slots in hand (and the room in
time and in the step's token budget for as many calls, controller.py), so its next call finds room at once rather
than behind the flood. Running calls are never pushed out; the lent slots come back as the borrower's calls
finish, which on a replica of many slots is every few tens of ms.

The work per decision is O(active tenants), at most one per slot plus those seen in the last seconds."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from .offered import Senders
from .settings import DEFAULT_SETTINGS


@dataclass
class Shares:
    num_slots: int
    weights: Mapping[str, float] = field(default_factory=dict)  # tenant -> weight; 1 for a tenant not named
    per_tenant: int = DEFAULT_SETTINGS.per_tenant_slots  # free slots kept for each modest tenant or under its share
    per_tenant_prompts: int = DEFAULT_SETTINGS.per_tenant_prompts  # room in the next step, for all those tenants
    tenants: Senders[str] = field(default_factory=Senders)  # each tenant's offer and the slots it holds

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """New weights (the ledger's, as the replica's policy refreshed): shares follow from the next decision."""
        self.weights = dict(weights)

    def arrive(self, tenant: str, now_ns: int, first: bool = True) -> None:
        """A call of `tenant` arrives: its first attempt (`first`) or a retry, which offers nothing new."""
        self.tenants.arrive(tenant, now_ns, first)

    def admit(self, tenant: str, hold_ns: int = 0) -> None:
        """A call of `tenant` was admitted, predicted to hold its slot `hold_ns`."""
        self.tenants.admit(tenant, hold_ns)

    def release(self, tenant: str) -> None:
        self.tenants.release(tenant)

    def share(self, tenant: str, now_ns: int) -> float:
        """The slots `tenant` is guaranteed now: its weight's part of the active tenants' (itself included)."""
        active = self.tenants.active(now_ns) | {tenant}
        return self._slots_per_weight(active) * self.weights.get(tenant, 1.0)

    def offered_slots(self, tenant: str, now_ns: int) -> float:
        """What `tenant` offers, in slots: its rate of first attempts lately × its calls' mean slot hold."""
        return self.tenants.offered_slots(tenant, now_ns)

    def kept_free(self, tenant: str, now_ns: int) -> int:
        """Free slots that `tenant` may not take, for the other active tenants it keeps them for (_keeps_for):
        `per_tenant` for each, or for a modest one as many as it offers if fewer (at least one), so that a few
        tenants sending a trickle do not lock a flood out of the replica. 0 for a modest tenant, which takes any
        free slot."""
        others, per_weight = self._others(tenant, now_ns)
        if not others or self._modest(tenant, per_weight, now_ns):
            return 0
        kept = 0
        for t in others:
            if self._keeps_for(tenant, t, per_weight, now_ns):
                offered = self.offered_slots(t, now_ns) if self._modest(t, per_weight, now_ns) else self.per_tenant
                kept += min(self.per_tenant, max(math.ceil(offered), 1))
        return kept

    def lent_to_others(self, tenant: str, now_ns: int) -> bool:
        """Another active tenant must keep slots for `tenant`: what it borrows is `tenant`'s to take back."""
        others, per_weight = self._others(tenant, now_ns)
        return any(self._keeps_for(t, tenant, per_weight, now_ns) for t in others)

    def _keeps_for(self, borrower: str, tenant: str, per_weight: float, now_ns: int) -> bool:
        """`borrower`, which offers more than its share, keeps slots for `tenant` if `tenant` is modest, or if
        `tenant` is under its share while `borrower` holds its own or more."""
        if self._modest(borrower, per_weight, now_ns):
            return False
        if self._modest(tenant, per_weight, now_ns):
            return True
        return not self._under(borrower, per_weight) and self._under(tenant, per_weight)

    def _others(self, tenant: str, now_ns: int) -> tuple[list[str], float]:
        """The other active tenants, and the slots per unit of weight with `tenant` counted among the active."""
        active = self.tenants.active(now_ns) | {tenant}
        return [t for t in active if t != tenant], self._slots_per_weight(active)

    def _slots_per_weight(self, active: set[str]) -> float:
        return self.num_slots / sum(self.weights.get(t, 1.0) for t in active)

    def _under(self, tenant: str, per_weight: float) -> bool:
        """One more call of `tenant` would still be inside its share."""
        return self.tenants.used[tenant] + 1 <= per_weight * self.weights.get(tenant, 1.0)

    def _modest(self, tenant: str, per_weight: float, now_ns: int) -> bool:
        """What `tenant` offers fits inside its share, on average."""
        return self.offered_slots(tenant, now_ns) + 1 <= per_weight * self.weights.get(tenant, 1.0)
