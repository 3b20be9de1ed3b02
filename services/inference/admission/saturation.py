"""Whether the replica is saturated: refusing a large share of new calls for a while, not just in a burst."""

from __future__ import annotations

from dataclasses import dataclass

from .settings import DEFAULT_SETTINGS

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
    after it. So a saturated replica does not invite retries to itself (it points them at other replicas), which
    keeps its goodput what it is without them."""

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
