"""The prediction behind admission: when each commitment finishes if all run from now. A prediction walks the
commitments in order of how many steps each still needs: between two finishes the batch is constant, so each
phase costs its number of steps × the step time at that batch size, and a call's finish is the expected time of
all phases up to its own plus `num_deviations` of their combined spread. Pending prompt tokens add their
marginal cost to everyone. No torch."""

from __future__ import annotations

import math
from operator import itemgetter

from ..cost.model import CostModel
from .decisions import AdmissionConfig, Commitment


def _steps_left(num_remaining_tokens: int, num_prefill_tokens: int, budget: int) -> int:
    """One step per token still to generate; a prompt longer than the step's token budget needs extra chunk
    steps before its first token."""
    return num_remaining_tokens + max(-(-num_prefill_tokens // budget) - 1, 0)


def _finish_ns(now_ns: int, mean_us: float, var_us2: float, num_deviations: float) -> int:
    return now_ns + int((mean_us + num_deviations * math.sqrt(var_us2)) * 1000)


def peak_occupancy(intervals: list[tuple[int, int]], start: int, end: int) -> int:
    """The most half-open intervals [s, e) open at once at any instant of [start, end)."""
    open_at_start, events = 0, []
    for s, e in intervals:
        if e <= start or s >= end:
            continue
        if s <= start:
            open_at_start += 1
        else:
            events.append((s, 1))
        if e < end:
            events.append((e, -1))
    peak = current = open_at_start
    for _, delta in sorted(events):  # at a tie an interval ends before another starts
        current += delta
        peak = max(peak, current)
    return peak


class Predictor:
    def __init__(self, cost: CostModel, config: AdmissionConfig, max_batch: int | None = None) -> None:
        self.cost = cost
        self.config = config
        self._max_batch = max_batch or 2 * config.num_slots + 1  # most commitments in one prediction
        self._cheapest_us: float | None = None

    def finish_times(self, commitments: list[Commitment], now_ns: int) -> dict[str, int]:
        """Predicted finish (engine clock) of every commitment if all run from now and nothing else joins."""
        if not commitments:
            return {}
        # Runs on every decision, several times on a refusal: one pass over plain tuples, no properties, no
        # calls per commitment (the step count is _steps_left's, inline); a finish per phase, not per call.
        budget, pace, cost = self.config.max_num_batched_tokens, self.config.pace_tokens, self.cost
        prefill_tokens, context_left, order = 0, 0, []
        for c in commitments:
            generated, prompt, max_tokens = c.num_generated, c.num_prompt_tokens, c.max_tokens
            remaining = max_tokens - generated if max_tokens > generated else 0
            if generated == 0:
                prefill_tokens += prompt
                if prompt > budget:
                    remaining += (prompt - 1) // budget  # chunk steps before the first token
            context_left += prompt + max_tokens
            order.append((remaining, prompt + max_tokens, c.key))
        order.sort(key=itemgetter(0))
        n = len(order)
        # paced, a step costs at least as much as with `pace` prompt tokens: those come at no extra cost
        mean_us = max(prefill_tokens - pace, 0) * cost.marginal_row_us(n + pace)
        finish, var_us2, done_steps, k, steps_us = {}, 0.0, 0, cost.num_deviations, cost.steps_us
        finish_ns = _finish_ns(now_ns, mean_us, var_us2, k)
        for i, (steps, final_context, key) in enumerate(order):
            if steps > done_steps:
                phase_us, phase_var = steps_us(steps - done_steps, n - i + pace, context_left)
                mean_us, var_us2, done_steps = mean_us + phase_us, var_us2 + phase_var, steps
                finish_ns = _finish_ns(now_ns, mean_us, var_us2, k)
            finish[key] = finish_ns
            context_left -= final_context
        return finish

    def earliest_finish(self, c: Commitment, now_ns: int) -> int:
        """A floor under `c`'s predicted finish from now, however many share its steps: as many steps as
        alone, each at the cheapest step time of any batch it could be part of, with no context but its own
        (finish_times never predicts less: every phase up to its finish is at least that)."""
        cost = self.cost
        steps = _steps_left(c.num_remaining_tokens, c.num_prefill_tokens, self.config.max_num_batched_tokens)
        raw_us = self._cheapest_step_us() + c.final_context * cost.us_per_context_token
        mean_us, var_us2 = steps * raw_us * cost.ratio, steps * (raw_us * cost.deviation) ** 2
        return _finish_ns(now_ns, mean_us, var_us2, cost.num_deviations)

    def _cheapest_step_us(self) -> float:
        """The least calibrated step time over every batch a prediction can see (1 to all commitments, plus
        the pace rows): the step time of the smallest batch when the calibration rises with the rows."""
        if self._cheapest_us is None:
            pace = self.config.pace_tokens
            self._cheapest_us = min(self.cost.raw_step_us(n + pace) for n in range(1, self._max_batch + 1))
        return self._cheapest_us

    def meets_deadlines(
        self, commitments: list[Commitment], new: Commitment, at_ns: int, before: dict[str, int]
    ) -> tuple[bool, int]:
        """Whether `new`, joining at `at_ns`, meets its deadline and pushes no commitment past a deadline it
        was predicted to meet; also `new`'s predicted finish."""
        after = self.finish_times([*commitments, new], at_ns)
        if after[new.key] > new.deadline_ns - self.margin_for(new, at_ns):
            return False, after[new.key]
        for c in commitments:
            limit = c.deadline_ns - self.margin_for(c, at_ns)
            if after[c.key] > limit and before.get(c.key, 0) <= limit:
                return False, after[new.key]
        return True, after[new.key]

    def margin_for(self, c: Commitment, now_ns: int) -> int:
        return self.config.margin_ns(max(c.deadline_ns - now_ns, 0))
