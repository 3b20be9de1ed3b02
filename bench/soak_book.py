"""bench/soak.py's book of what the client saw, which its summary (soak_report.py) reads."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass
class Book:
    """What the client saw: admitted call_id -> (tenant, sm_us of its Final or None), tallies, latencies."""

    admitted: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    tally: Counter = field(default_factory=Counter)  # (kind, code, reason)
    latency_ms: list[float] = field(default_factory=list)  # normal calls that finished: start -> Final
    recent_ids: deque = field(default_factory=lambda: deque(maxlen=256))  # (tenant, request_id)
    imprecise: list[dict] = field(default_factory=list)  # bad input not refused precisely
    num_imprecise: int = 0
    max_lag_ms: float = 0.0
    rss: list[tuple[float, int | None, int | None]] = field(default_factory=list)  # (s, server kB, engine kB)
    health_ms: list[float] = field(default_factory=list)
    health_failures: Counter = field(default_factory=Counter)
    loop_lag_ms: list[float] = field(default_factory=list)  # this generator's own event-loop delay
    health_slow: list[tuple[float, float]] = field(default_factory=list)  # (s, ms) of Checks over the goal
    bad_log: list[tuple[float, str, str]] = field(default_factory=list)  # (s, mutation, code): vs health_slow
    by_minute: dict[int, Counter] = field(default_factory=dict)  # codes per minute: shows a lock-out
    infeasible_first: int = 0  # soak-shape calls whose first attempt (whole 2 s budget) was "infeasible"
    t0: float = field(default_factory=time.monotonic)
    cpu_cores: dict[str, float] = field(default_factory=dict)
    in_flight: Counter = field(default_factory=Counter)  # (tenant, request_id) of SDK calls not ended
    shared: set = field(default_factory=set)  # keys two of whose calls ran at once: either may be "in use"
    wrong_in_use: int = 0  # ALREADY_EXISTS for an id its tenant had no call running with

    def count(self, kind: str, code: str, reason: str) -> None:
        self.tally[(kind, code, reason)] += 1
        self.by_minute.setdefault(int((time.monotonic() - self.t0) // 60), Counter())[code] += 1
