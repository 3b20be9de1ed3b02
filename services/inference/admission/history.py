"""What admission learns from how its calls went, one record each: how much later than predicted calls finish
(`Lateness`), whether a tenant has been refused most of the time lately (`Saturation`), and whether its refused
calls come back for their reservations (`FollowThrough`). No torch.

How much later than predicted admitted calls really finish, which is when their KV slots really free.

Whether the replica is saturated: refusing a large share of new calls for a while, not just in a burst.

Whether a refused call's retry will come for its reservation: learnt per tenant from what became of the
reservations already made, because nothing on the wire says how many attempts a client has left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .settings import DEFAULT_SETTINGS


@dataclass
class Lateness:
    """How much later than predicted admitted calls really finish: a prediction assumes nothing else joins,
    but later arrivals share the steps. Running mean and mean absolute deviation of actual/predicted time
    to finish; slots are expected to free `factor` times later than predicted. Fed only by calls that ran all
    their max_tokens, the run their prediction priced (service.close): one that stopped early says nothing of
    the device's pace, and its small ratio would only widen the deviation."""

    alpha: float = DEFAULT_SETTINGS.lateness_alpha
    mean: float = 1.0
    deviation: float = 0.0
    num_deviations: float = DEFAULT_SETTINGS.lateness_num_deviations
    # kept, not derived on each use: a refusal stretches every running call's finish at each retry candidate
    factor: float = field(init=False, default=1.0)

    def __post_init__(self) -> None:
        self._update_factor()

    def observe(self, predicted_ns: int, actual_ns: int) -> None:
        if predicted_ns > 0:
            ratio = actual_ns / predicted_ns
            self.mean += self.alpha * (ratio - self.mean)
            self.deviation += self.alpha * (abs(ratio - self.mean) - self.deviation)
            self._update_factor()

    def _update_factor(self) -> None:
        self.factor = max(1.0, self.mean + self.num_deviations * self.deviation)

    def stretch(self, start_ns: int, end_ns: int) -> int:
        return start_ns + int((end_ns - start_ns) * self.factor)


NS_PER_S = 1_000_000_000


@dataclass
class Saturation:
    """The share of first attempts refused lately (retries are not counted: they would feed it themselves), each
    weighted by its age (half-life `half_life_s`), with hysteresis so that the verdict does not flap; judged only
    once `min_weight` attempts' worth are that recent, so a few refusals at a low rate are no verdict, and only
    once the share has stayed over `enter` for `hold_s`, so a burst into a full replica is no verdict either.

    A burst refuses a few calls and their retries find the slots reserved for them; a saturated replica has no
    slot to spare for anyone. There a retry can only take the place of another call, and a worse one: it comes
    with less of its budget left, so it is admitted with less slack and holds back the prompts of those admitted
    after it. So a saturated replica with others beside it does not invite retries to itself (it points them at
    the other replicas), which keeps its goodput what it is without them; a replica alone invites only the retries
    it can promise a slot with room to spare (`AdmissionSettings.elsewhere`, refusals.py).

    A verdict must not outlive its cause: once the replica has drained (its last admitted call released), what
    the burst before taught says nothing of the next one, which is judged afresh (`relieve`)."""

    half_life_s: float = DEFAULT_SETTINGS.saturation_half_life_s
    enter: float = DEFAULT_SETTINGS.saturation_enter_share
    leave: float = DEFAULT_SETTINGS.saturation_leave_share
    min_weight: float = DEFAULT_SETTINGS.saturation_min_attempts
    hold_s: float = DEFAULT_SETTINGS.saturation_hold_s
    above_since_ns: int | None = None  # when the share last rose over `enter`
    refused: float = 0.0  # age-weighted counts
    weight: float = 0.0
    last_ns: int | None = None
    saturated: bool = False

    @property
    def share(self) -> float:
        return self.refused / self.weight if self.weight else 0.0

    def relieve(self) -> None:
        """The replica drained: the verdict and the evidence behind it go."""
        self.refused = self.weight = 0.0
        self.saturated, self.above_since_ns = False, None

    def observe(self, refused: bool, now_ns: int) -> None:
        if self.last_ns is not None and now_ns > self.last_ns:
            keep = 0.5 ** ((now_ns - self.last_ns) / NS_PER_S / self.half_life_s)
            self.refused *= keep
            self.weight *= keep
        self.last_ns = max(now_ns, self.last_ns or now_ns)
        self.refused += 1.0 if refused else 0.0
        self.weight += 1.0
        share = self.share
        if self.saturated:
            if share < self.leave or self.weight < self.min_weight:
                self.saturated, self.above_since_ns = False, None
        elif share > self.enter and self.weight >= self.min_weight:
            if self.above_since_ns is None:
                self.above_since_ns = now_ns
            self.saturated = now_ns - self.above_since_ns >= self.hold_s * NS_PER_S
        else:
            self.above_since_ns = None


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
