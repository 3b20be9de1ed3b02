"""Whether a refused call's retry will come for its reservation: learnt per tenant from what became of the
reservations already made, because nothing on the wire says how many attempts a client has left."""

from __future__ import annotations

from dataclasses import dataclass, field

from .settings import DEFAULT_SETTINGS


@dataclass
class FollowThrough:
    """The share of a tenant's reservations whose retry came on time, as a running mean, kept apart for first
    refusals and for refusals of a retry (a client that retries once comes back after the first, never after
    the second). A slot held for a retry that never comes is capacity lost twice: idle while it waits, and
    refused to the newcomers planned around it. So a reservation is made only where retries have been coming;
    elsewhere the hint is still sent, unbacked. Every `explore_every`-th unbacked refusal reserves anyway, so a
    tenant whose clients start retrying is seen to. Bounded: past `max_tenants`, the least recently seen
    tenant's rates are forgotten."""

    alpha: float = DEFAULT_SETTINGS.follow_alpha
    threshold: float = DEFAULT_SETTINGS.follow_threshold_share
    explore_every: int = DEFAULT_SETTINGS.follow_explore_every
    max_tenants: int = DEFAULT_SETTINGS.max_tenants
    rates: dict[tuple[str, bool], float] = field(default_factory=dict)  # (tenant, after a retry) -> share
    skipped: dict[tuple[str, bool], int] = field(default_factory=dict)  # unbacked refusals since a reservation

    def expects(self, tenant: str, again: bool) -> bool:
        """Whether to reserve for this refusal; counts it as skipped when not."""
        key = (tenant, again)
        if self.rates.get(key, 1.0) >= self.threshold:  # a tenant not seen yet is trusted
            return True
        skipped = self.skipped.get(key, 0) + 1
        if skipped >= self.explore_every:
            self.skipped[key] = 0
            return True
        self.skipped[key] = skipped
        return False

    def observe(self, tenant: str, again: bool, came: bool) -> None:
        """A reservation was taken up on time (came) or lapsed."""
        key = (tenant, again)
        rate = self.rates.pop(key, 1.0)
        self.rates[key] = rate + self.alpha * ((1.0 if came else 0.0) - rate)  # re-inserted: most recent last
        while len(self.rates) > self.max_tenants:
            oldest = next(iter(self.rates))
            del self.rates[oldest]
            self.skipped.pop(oldest, None)
