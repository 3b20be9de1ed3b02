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
from dataclasses import dataclass, field

from .decisions import Commitment
from .offered import Senders
from .settings import DEFAULT_SETTINGS


@dataclass(frozen=True, slots=True)
class Kept:
    """The headroom kept for one higher level: slots (and phantom calls), each shaped as its latest call."""

    num_slots: int
    num_prompt_tokens: int
    max_tokens: int
    budget_ns: int


@dataclass
class Priorities:
    per_class: int = DEFAULT_SETTINGS.per_class_slots  # free slots kept for each active higher level, at most
    max_slots: int | None = None  # free slots kept for all higher levels together, at most (None: no bound)
    per_class_prompts: int = DEFAULT_SETTINGS.per_class_prompts  # room in the next step, for all those levels
    levels: Senders[int] = field(default_factory=Senders)  # each priority level's offer and the slots it holds
    # each level's latest call, (prompt tokens, max tokens, budget ns): what its headroom must fit. At most one
    # entry per priority value (0..100), so it is never pruned.
    _shapes: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def arrive(self, call: Commitment, now_ns: int, first: bool = True) -> None:
        """`call` arrives: its first attempt (`first`) or a retry, which offers nothing new."""
        self.levels.arrive(call.priority, now_ns, first)
        self._shapes[call.priority] = (call.num_prompt_tokens, call.max_tokens, call.deadline_ns - now_ns)

    def admit(self, priority: int, hold_ns: int = 0) -> None:
        self.levels.admit(priority, hold_ns)

    def release(self, priority: int) -> None:
        self.levels.release(priority)

    def above(self, priority: int, now_ns: int) -> list[Kept]:
        """The headroom a call of `priority` must leave for each active level above it."""
        offers = self.levels.offers
        if len(offers) == 1 and priority in offers:  # one class: nothing above (the common case)
            return []
        active = self.levels.active(now_ns)
        kept, left = [], self.max_slots
        for p in sorted((p for p in active if p > priority), reverse=True):  # the highest keep theirs first
            offered = self.levels.offered_slots(p, now_ns)
            num_slots = min(self.per_class, max(math.ceil(offered), 1), self.per_class if left is None else left)
            if num_slots <= 0:
                break
            kept.append(Kept(num_slots, *self._shapes[p]))
            left = None if left is None else left - num_slots
        return kept
