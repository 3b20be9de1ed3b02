"""What a sender (a tenant, a class) offers the replica, in slots: the rate of its first attempts lately × how long
its calls hold a slot. Retries are not counted: they offer nothing new. `Senders` keeps one Offer per sender and
the slots each holds, for fair share (shares.py, by tenant) and class priority (priorities.py, by level). No torch."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Generic, TypeVar

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
