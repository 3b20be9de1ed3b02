"""Class priority under overload: headroom kept for the higher classes that are active. No torch.

Each call carries its class's priority (0..100, higher first). A priority level is active while it has calls
running or has had calls lately (age-weighted, half-life `half_life_s`). A call may not take the last
`per_class` free slots kept for each active level above its own, nor the room in time and in the step's token
budget that as many calls of that level, shaped as its latest call, would need (controller.py adds them as
phantom calls). So when only that headroom is left, a batch call is refused (cause `priority`) and the
interactive call that arrives after it is admitted. Running calls are never pushed out.

The levels are few (a class each): the work per decision is O(active levels)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

NS_PER_S = 1_000_000_000


@dataclass
class _Level:
    arrivals: float  # age-weighted
    as_of_ns: int
    num_prompt_tokens: int  # the shape of its latest call: what its headroom must fit
    max_tokens: int
    budget_ns: int


@dataclass
class Priorities:
    per_class: int = 4  # free slots kept for each active higher level
    per_class_prompts: int = 2  # of those, prompts kept room for in the next step's token budget
    half_life_s: float = 2.0
    active_weight: float = 0.25  # age-weighted arrivals below which a level with nothing running is idle
    used: Counter[int] = field(default_factory=Counter)  # slots held by admitted calls, by level
    _levels: dict[int, _Level] = field(default_factory=dict)

    def arrive(self, priority: int, num_prompt_tokens: int, max_tokens: int, budget_ns: int, now_ns: int) -> None:
        level = self._levels.get(priority)
        if level is None:
            self._levels[priority] = _Level(1.0, now_ns, num_prompt_tokens, max_tokens, budget_ns)
            return
        level.arrivals, level.as_of_ns = self._aged(level, now_ns) + 1.0, max(now_ns, level.as_of_ns)
        level.num_prompt_tokens, level.max_tokens, level.budget_ns = num_prompt_tokens, max_tokens, budget_ns

    def admit(self, priority: int) -> None:
        self.used[priority] += 1

    def release(self, priority: int) -> None:
        self.used[priority] -= 1
        if self.used[priority] <= 0:
            del self.used[priority]

    def above(self, priority: int, now_ns: int) -> list[tuple[int, int, int]]:
        """The shape (prompt tokens, max tokens, budget ns) of each active level above `priority`: each keeps
        `per_class` slots, and the room in time for as many of its calls, from a call of `priority`."""
        if len(self._levels) == 1 and priority in self._levels:  # one class: nothing above (the common case)
            return []
        self._forget_idle(now_ns)
        return [
            (level.num_prompt_tokens, level.max_tokens, level.budget_ns)
            for p, level in self._levels.items()
            if p > priority
        ]

    def _forget_idle(self, now_ns: int) -> None:
        levels = self._levels
        for p in [p for p, lv in levels.items() if p not in self.used and self._aged(lv, now_ns) < self.active_weight]:
            del self._levels[p]

    def _aged(self, level: _Level, now_ns: int) -> float:
        return level.arrivals * 0.5 ** (max(now_ns - level.as_of_ns, 0) / NS_PER_S / self.half_life_s)
