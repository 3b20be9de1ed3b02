"""How much later than predicted admitted calls really finish, which is when their KV slots really free."""

from __future__ import annotations

from dataclasses import dataclass, field

from .settings import DEFAULT_SETTINGS


@dataclass
class Lateness:
    """How much later than predicted admitted calls really finish: a prediction assumes nothing else joins,
    but later arrivals share the steps. Running mean and mean absolute deviation of actual/predicted time
    to finish; slots are expected to free `factor` times later than predicted."""

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
