"""One clock for the service: monotonic for deadlines and intervals, anchored to the epoch for reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Clock:
    mono_anchor_ns: int = field(default_factory=time.monotonic_ns)
    epoch_anchor_ns: int = field(default_factory=time.time_ns)

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def epoch_us(self, mono_ns: int) -> int:
        """µs since the Unix epoch of an engine-clock instant."""
        return (self.epoch_anchor_ns + mono_ns - self.mono_anchor_ns) // 1000

    def now_epoch_us(self) -> int:
        return self.epoch_us(self.now_ns())
