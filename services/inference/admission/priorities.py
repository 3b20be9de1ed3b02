"""Class priority under overload: headroom kept for the higher classes that are active. No torch.

Each call carries its class's priority (0..100, higher first). A priority level is active while it has calls
running or has had calls lately (age-weighted, half-life `half_life_s`). A call may not take the last free slots
kept for each active level above its own: `per_class`, or as many as that level offers if fewer (at least one;
offered.py), so that classes sending a trickle do not lock the lower ones out, and all levels together keep at most
`max_slots` (the controller's: a quarter of the slots, so that a replica of few slots is never held for a class
that sends one call). Nor may it take the room in time
that as many calls of that level, shaped as its latest call, would need (controller.py adds them as phantom calls),
nor the room for `per_class_prompts` prompts in the next step's token budget. So when only that headroom is left,
a batch call is refused (cause `priority`) and the interactive call that arrives after it is admitted. Running
calls are never pushed out.

The levels are few (a class each): the work per decision is O(active levels)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from .decisions import Commitment
from .offered import Offer


@dataclass(slots=True)
class _Level:
    offer: Offer
    num_prompt_tokens: int  # the shape of its latest call: what its headroom must fit
    max_tokens: int
    budget_ns: int


@dataclass(frozen=True, slots=True)
class Kept:
    """The headroom kept for one higher level: slots (and phantom calls), each shaped as its latest call."""

    num_slots: int
    num_prompt_tokens: int
    max_tokens: int
    budget_ns: int


@dataclass
class Priorities:
    per_class: int = 4  # free slots kept for each active higher level, at most
    max_slots: int | None = None  # free slots kept for all higher levels together, at most (None: no bound)
    per_class_prompts: int = 2  # prompts kept room for in the next step's token budget, for all those levels
    half_life_s: float = 2.0
    offered_half_life_s: float = 8.0
    active_weight: float = 0.25  # age-weighted arrivals below which a level with nothing running is idle
    hold_alpha: float = 0.05
    used: Counter[int] = field(default_factory=Counter)  # slots held by admitted calls, by level
    _levels: dict[int, _Level] = field(default_factory=dict)
    _mean_hold_ns: float = 0.0

    def arrive(self, call: Commitment, now_ns: int, first: bool = True) -> None:
        """`call` arrives: its first attempt (`first`) or a retry, which offers nothing new."""
        level = self._levels.get(call.priority)
        if level is None:
            level = self._levels[call.priority] = _Level(Offer(now_ns, now_ns), 0, 0, 0)
        level.offer.age(now_ns, self.half_life_s, self.offered_half_life_s)
        level.offer.arrive(first)
        level.num_prompt_tokens, level.max_tokens = call.num_prompt_tokens, call.max_tokens
        level.budget_ns = call.deadline_ns - now_ns

    def admit(self, priority: int, hold_ns: int = 0) -> None:
        self.used[priority] += 1
        if priority in self._levels:
            self._levels[priority].offer.admit(hold_ns, self.hold_alpha)
        if hold_ns > 0:
            mean = self._mean_hold_ns
            self._mean_hold_ns = hold_ns if not mean else mean + self.hold_alpha * (hold_ns - mean)

    def release(self, priority: int) -> None:
        self.used[priority] -= 1
        if self.used[priority] <= 0:
            del self.used[priority]

    def above(self, priority: int, now_ns: int) -> list[Kept]:
        """The headroom a call of `priority` must leave for each active level above it."""
        if len(self._levels) == 1 and priority in self._levels:  # one class: nothing above (the common case)
            return []
        self._forget_idle(now_ns)
        kept, left = [], self.max_slots
        for p in sorted((p for p in self._levels if p > priority), reverse=True):  # the highest keep theirs first
            level = self._levels[p]
            offered = level.offer.slots(now_ns, self.offered_half_life_s, self._mean_hold_ns)
            num_slots = min(self.per_class, max(math.ceil(offered), 1), self.per_class if left is None else left)
            if num_slots <= 0:
                break
            kept.append(Kept(num_slots, level.num_prompt_tokens, level.max_tokens, level.budget_ns))
            left = None if left is None else left - num_slots
        return kept

    def _forget_idle(self, now_ns: int) -> None:
        for p in [p for p, level in self._levels.items() if p not in self.used and self._idle(level, now_ns)]:
            del self._levels[p]

    def _idle(self, level: _Level, now_ns: int) -> bool:
        level.offer.age(now_ns, self.half_life_s, self.offered_half_life_s)
        return level.offer.arrivals < self.active_weight
