"""The headroom a call must leave for others, and what it is sized by: what each sender offers (`Senders`), each
tenant's fair share (`Shares`), each active higher class's priority (`Priorities`), and the three ways they are kept
(`headroom`). One room because the decision's second check ("headroom kept for others") asks all of them at once.
No torch.

Offers. What a sender (a tenant, a class) offers the replica, in slots: the rate of its first attempts lately × how long
its calls hold a slot. Retries are not counted: they offer nothing new. `Senders` keeps one Offer per sender and
the slots each holds, for fair share (`Shares`, by tenant) and class priority (`Priorities`, by level).

Fair share: each tenant's share of the replica's slots, and who may borrow what others leave unused.

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

The work per decision is O(active tenants), at most one per slot plus those seen in the last seconds.

Class priority under overload: headroom kept for the higher classes that are active.

Each call carries its class's priority (0..100, higher first). A priority level is active while it has calls
running or has had calls lately (age-weighted, half-life `half_life_s`). A call may not take the last free slots
kept for each active level above its own: `per_class`, or as many as that level offers if fewer (at least one;
`Senders`), so that classes sending a trickle do not lock the lower ones out, and all levels together keep at most
`max_slots` (the controller's: a quarter of the slots, so that a replica of few slots is never held for a class
that sends one call). Nor may it take the room in time
that as many calls of that level, shaped as its latest call, would need (controller.py adds them as phantom calls),
nor the room for `per_class_prompts` prompts in the next step's token budget. So when only that headroom is left,
a batch call is refused (cause `priority`) and the interactive call that arrives after it is admitted. Running
calls are never pushed out.

The levels are few (a class each): the work per decision is O(active levels).

Headroom: what a call must leave free for others when it is admitted: the headroom kept for modest tenants and tenants
under their share (`Shares`) and for active higher-priority classes (`Priorities`).

Headroom is kept three ways, so that the call it is kept for finds room at once: free slots; room in time, as
phantom calls that must still meet their deadlines beside the running ones and the new one; and room in the next
step's token budget for some of those phantoms' prompts. The controller checks all three (controller.py).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .decisions import Commitment
from .settings import DEFAULT_SETTINGS

NS_PER_S = 1_000_000_000
K = TypeVar("K")  # a sender's key: a tenant's name, a priority level


@dataclass(slots=True)
class Offer:
    """Age-weighted counts of one sender's calls: every attempt (it is active) and first attempts (what it offers,
    on a longer half-life, so that a Poisson stream reads steady); and the mean predicted slot hold of its calls."""

    since_ns: int  # first seen: a sender seen for less than the half-life is not diluted by the time before
    as_of_ns: int
    arrivals: float = 0.0
    offered: float = 0.0
    hold_ns: float = 0.0  # 0: none admitted yet

    def age(self, now_ns: int, half_life_s: float, offered_half_life_s: float) -> None:
        if now_ns > self.as_of_ns:
            age_s = (now_ns - self.as_of_ns) / NS_PER_S
            self.arrivals *= 0.5 ** (age_s / half_life_s)
            self.offered *= 0.5 ** (age_s / offered_half_life_s)
            self.as_of_ns = now_ns

    def arrive(self, first: bool) -> None:
        """A call arrives (after `age`): a first attempt or a retry."""
        self.arrivals += 1.0
        self.offered += 1.0 if first else 0.0

    def admit(self, hold_ns: int, alpha: float) -> None:
        """One of its calls was admitted, predicted to hold its slot `hold_ns`."""
        if hold_ns > 0:
            self.hold_ns = hold_ns if not self.hold_ns else self.hold_ns + alpha * (hold_ns - self.hold_ns)

    def slots(self, now_ns: int, offered_half_life_s: float, default_hold_ns: float) -> float:
        """What it offers, in slots: its rate of first attempts lately × its calls' mean slot hold (or the default,
        before any is admitted)."""
        decay = 0.5 ** (max(now_ns - self.as_of_ns, 0) / NS_PER_S / offered_half_life_s)
        seen_s = max((now_ns - self.since_ns) / NS_PER_S, 0.1 * offered_half_life_s)
        window_s = offered_half_life_s / math.log(2) * (1 - 0.5 ** (seen_s / offered_half_life_s))
        return self.offered * decay / window_s * (self.hold_ns or default_hold_ns) / NS_PER_S


@dataclass
class Senders(Generic[K]):
    """The senders of calls (tenants for fair share, priority levels for classes): each one's Offer, the slots
    its admitted calls hold, and the mean predicted slot hold over all of them (a new sender's guess). A sender
    with nothing running whose age-weighted arrivals fall below `active_weight` is idle, and forgotten."""

    half_life_s: float = DEFAULT_SETTINGS.active_half_life_s
    offered_half_life_s: float = DEFAULT_SETTINGS.offered_half_life_s  # of the rate a sender offers
    active_weight: float = DEFAULT_SETTINGS.active_weight
    hold_alpha: float = DEFAULT_SETTINGS.hold_alpha  # weight of the newest admitted call in a mean slot hold
    used: Counter[K] = field(default_factory=Counter)  # slots held by admitted calls, by sender
    offers: dict[K, Offer] = field(default_factory=dict)
    mean_hold_ns: float = 0.0

    def aged(self, key: K, now_ns: int) -> Offer:
        """`key`'s record, its counts aged to `now_ns` (made if new)."""
        offer = self.offers.get(key)
        if offer is None:
            offer = self.offers[key] = Offer(since_ns=now_ns, as_of_ns=now_ns)
        offer.age(now_ns, self.half_life_s, self.offered_half_life_s)
        return offer

    def arrive(self, key: K, now_ns: int, first: bool) -> None:
        """A call of `key` arrives: its first attempt (`first`) or a retry, which offers nothing new."""
        self.aged(key, now_ns).arrive(first)

    def admit(self, key: K, hold_ns: int) -> None:
        """A call of `key` was admitted, predicted to hold its slot `hold_ns`."""
        self.used[key] += 1
        if key in self.offers:
            self.offers[key].admit(hold_ns, self.hold_alpha)
        if hold_ns > 0:
            mean = self.mean_hold_ns
            self.mean_hold_ns = hold_ns if not mean else mean + self.hold_alpha * (hold_ns - mean)

    def release(self, key: K) -> None:
        self.used[key] -= 1
        if self.used[key] <= 0:
            del self.used[key]

    def offered_slots(self, key: K, now_ns: int) -> float:
        """What `key` offers, in slots: its rate of first attempts lately × its calls' mean slot hold."""
        offer = self.offers.get(key)
        return 0.0 if offer is None else offer.slots(now_ns, self.offered_half_life_s, self.mean_hold_ns)

    def active(self, now_ns: int) -> set[K]:
        """The senders with calls running or sent lately; the idle ones are forgotten, so the set stays as small as
        the senders really sending."""
        idle = [k for k in self.offers if k not in self.used and self.aged(k, now_ns).arrivals < self.active_weight]
        for k in idle:
            del self.offers[k]
        return set(self.offers) | set(self.used)


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


@dataclass(frozen=True, slots=True)
class Kept:
    """The headroom kept for one higher level: slots (and phantom calls), each shaped as its latest call."""

    num_slots: int
    num_prompt_tokens: int
    max_tokens: int
    budget_ns: int


@dataclass
class Priorities:
    per_class: int = DEFAULT_SETTINGS.per_class_slots  # free slots kept for each active higher level, at most
    max_slots: int | None = None  # free slots kept for all higher levels together, at most (None: no bound)
    per_class_prompts: int = DEFAULT_SETTINGS.per_class_prompts  # room in the next step, for all those levels
    levels: Senders[int] = field(default_factory=Senders)  # each priority level's offer and the slots it holds
    # each level's latest call, (prompt tokens, max tokens, budget ns): what its headroom must fit. At most one
    # entry per priority value (0..100), so it is never pruned.
    _shapes: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def arrive(self, call: Commitment, now_ns: int, first: bool = True) -> None:
        """`call` arrives: its first attempt (`first`) or a retry, which offers nothing new."""
        self.levels.arrive(call.priority, now_ns, first)
        self._shapes[call.priority] = (call.num_prompt_tokens, call.max_tokens, call.deadline_ns - now_ns)

    def admit(self, priority: int, hold_ns: int = 0) -> None:
        self.levels.admit(priority, hold_ns)

    def release(self, priority: int) -> None:
        self.levels.release(priority)

    def above(self, priority: int, now_ns: int) -> list[Kept]:
        """The headroom a call of `priority` must leave for each active level above it."""
        offers = self.levels.offers
        if len(offers) == 1 and priority in offers:  # one class: nothing above (the common case)
            return []
        active = self.levels.active(now_ns)
        kept, left = [], self.max_slots
        for p in sorted((p for p in active if p > priority), reverse=True):  # the highest keep theirs first
            offered = self.levels.offered_slots(p, now_ns)
            num_slots = min(self.per_class, max(math.ceil(offered), 1), self.per_class if left is None else left)
            if num_slots <= 0:
                break
            kept.append(Kept(num_slots, *self._shapes[p]))
            left = None if left is None else left - num_slots
        return kept


@dataclass(frozen=True, slots=True)
class Headroom:
    for_tenants: int = 0  # free slots kept for other tenants
    for_classes: int = 0  # free slots kept for higher-priority classes
    phantoms: tuple[Commitment, ...] = ()  # calls that must still fit in time: the tenants' first, then the classes'
    num_tenant_phantoms: int = 0
    prompts: tuple[Commitment, ...] = ()  # the phantoms whose prompts keep room in the next step's token budget

    @property
    def num_slots(self) -> int:
        return self.for_tenants + self.for_classes


NONE = Headroom()


def headroom(shares: Shares, priorities: Priorities, new: Commitment, now_ns: int) -> Headroom:
    """The headroom `new` must leave: O(active tenants + active classes) to find, a phantom per kept slot."""
    for_tenants = shares.kept_free(new.tenant, now_ns)
    above = priorities.above(new.priority, now_ns)
    if not for_tenants and not above:
        return NONE
    # a phantom of a tenant is shaped as `new` (its deadline too); a phantom of a class as that class's latest call
    phantoms = [
        Commitment(f"\0kept{i}", new.num_prompt_tokens, new.max_tokens, new.deadline_ns) for i in range(for_tenants)
    ]
    # room in the next step for a few prompts, whichever tenant's call comes first, and whichever class's
    tenant_prompts, class_prompts = phantoms[: shares.per_tenant_prompts], []
    for level, kept in enumerate(above):
        mine = [
            Commitment(f"\0class{level}/{i}", kept.num_prompt_tokens, kept.max_tokens, now_ns + kept.budget_ns)
            for i in range(kept.num_slots)
        ]
        phantoms += mine
        class_prompts += mine[: priorities.per_class_prompts - len(class_prompts)]
    return Headroom(
        for_tenants=for_tenants,
        for_classes=len(phantoms) - for_tenants,
        phantoms=tuple(phantoms),
        num_tenant_phantoms=for_tenants,
        prompts=(*tenant_prompts, *class_prompts),
    )


def holding_against(new: Commitment, room: Headroom, reservations: list[Commitment]) -> list[Commitment]:
    """The reservations that hold their slots against `new`: all but those of a lower class, unless `new` must keep
    headroom for other tenants (a tenant over its share takes no slot reserved for another, whatever its class)."""
    if room.for_tenants:
        return reservations
    return [r for r in reservations if r.held or r.priority >= new.priority]  # a held call was admitted: it holds
