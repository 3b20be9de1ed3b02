"""What a sender (a tenant, a class) offers the replica, in slots: the rate of its first attempts lately × how long
its calls hold a slot. Retries are not counted: they offer nothing new. No torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

NS_PER_S = 1_000_000_000


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
