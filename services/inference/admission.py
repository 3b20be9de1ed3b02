"""Admission at arrival: admit only what the cost model predicts finishes inside its deadline. No torch.

Runs on the event loop thread, which owns the set of commitments (admitted requests and reserved retries).
Progress comes back from the token streams. A prediction walks the commitments in order of how many
steps each still needs: between two finishes the batch is constant, so each phase costs its number of
steps × the step time at that batch size. Pending prompt tokens add their marginal cost to everyone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .costmodel import CostModel

NS_PER_MS = 1_000_000


@dataclass
class Commitment:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    deadline_ns: int
    num_generated: int = 0
    reserved_from_ns: int | None = None     # set while this is a reservation for a hinted retry:
    reserved_until_ns: int | None = None    # the retry is expected from `from` and held until `until`

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_prompt_tokens if self.num_generated == 0 else 0

    @property
    def num_remaining_tokens(self) -> int:
        return max(self.max_tokens - self.num_generated, 0)

    @property
    def final_context(self) -> int:
        return self.num_prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class AdmissionConfig:
    num_slots: int
    max_num_batched_tokens: int
    margin_ms: float = 20.0                 # fixed part of the safety margin
    margin_fraction: float = 0.05           # proportional part, of the budget

    def margin_ns(self, budget_ns: int) -> int:
        return int(self.margin_ms * NS_PER_MS + self.margin_fraction * budget_ns)

    def min_budget_ns(self, work_ns: int) -> int:
        """The smallest budget B with work + margin(B) <= B."""
        return math.ceil((work_ns + self.margin_ms * NS_PER_MS) / (1 - self.margin_fraction))


@dataclass(frozen=True)
class Admit:
    predicted_finish_ns: int


@dataclass(frozen=True)
class Reject:
    retry_after_ms: int
    predicted_finish_ns: int


@dataclass(frozen=True)
class Infeasible:
    min_budget_ms: int


Decision = Admit | Reject | Infeasible


class Predictor:
    def __init__(self, cost: CostModel, config: AdmissionConfig) -> None:
        self.cost = cost
        self.config = config

    def finish_times(self, commitments: list[Commitment], now_ns: int) -> dict[str, int]:
        """Predicted finish (engine clock) of every commitment if nothing else joins."""
        if not commitments:
            return {}
        budget = self.config.max_num_batched_tokens
        prefill_tokens = sum(c.num_prefill_tokens for c in commitments)
        # Each request needs one step per token it still generates; its prompt may need extra chunk steps.
        steps = {c.request_id: c.num_remaining_tokens + max(math.ceil(c.num_prefill_tokens / budget) - 1, 0)
                 for c in commitments}
        order = sorted(commitments, key=lambda c: steps[c.request_id])
        n = len(order)
        prefill_us = prefill_tokens * self.cost.marginal_row_us(n)
        context_left = sum(c.final_context for c in order)
        finish, elapsed_us, done_steps = {}, prefill_us, 0
        for i, c in enumerate(order):
            phase_steps = steps[c.request_id] - done_steps
            if phase_steps > 0:
                elapsed_us += phase_steps * self.cost.step_us(n - i, context_left)
                done_steps = steps[c.request_id]
            finish[c.request_id] = now_ns + int(elapsed_us * 1000)
            context_left -= c.final_context
        return finish

    def fits(self, commitments: list[Commitment], new: Commitment, now_ns: int,
             before: dict[str, int]) -> tuple[bool, int]:
        """Whether `new` meets its deadline and pushes no commitment past a deadline it was predicted to meet."""
        after = self.finish_times([*commitments, new], now_ns)
        ok = len(commitments) < self.config.num_slots
        ok = ok and after[new.request_id] <= new.deadline_ns - self.margin_for(new, now_ns)
        for c in commitments:
            limit = c.deadline_ns - self.margin_for(c, now_ns)
            if after[c.request_id] > limit and before.get(c.request_id, 0) <= limit:
                ok = False
                break
        return ok, after[new.request_id]

    def margin_for(self, c: Commitment, now_ns: int) -> int:
        return self.config.margin_ns(max(c.deadline_ns - now_ns, 0))


class AdmissionController:
    """Deadline mode: predict at arrival, admit or reject at once with a retry delay and a reservation."""

    def __init__(self, cost: CostModel, config: AdmissionConfig, reservation_grace_ms: float = 50.0,
                 max_reservations: int | None = None) -> None:
        self.predictor = Predictor(cost, config)
        self.config = config
        self.commitments: dict[str, Commitment] = {}
        self.reservation_grace_ns = int(reservation_grace_ms * NS_PER_MS)
        # a rejection storm must not grow the work of every decision: at most this many reservations
        self.max_reservations = config.num_slots if max_reservations is None else max_reservations

    @property
    def num_reserved(self) -> int:
        return len(self.commitments) - self.num_admitted

    @property
    def num_admitted(self) -> int:
        return sum(1 for c in self.commitments.values() if c.reserved_from_ns is None)

    def decide(self, new: Commitment, now_ns: int) -> Decision:
        self._expire_reservations(now_ns)
        held = self.commitments.get(new.request_id)
        if held is not None and held.reserved_from_ns is not None:
            del self.commitments[new.request_id]            # a retry consumes its own reservation
        idle = self.predictor.finish_times([new], now_ns)[new.request_id]
        if idle > new.deadline_ns - self.predictor.margin_for(new, now_ns):
            return Infeasible(min_budget_ms=math.ceil(self.config.min_budget_ns(idle - now_ns) / NS_PER_MS))
        ok, finish_ns, current, before = self._check(new, now_ns)
        if ok:
            self.commitments[new.request_id] = new
            return Admit(finish_ns)
        retry_ns = self._retry_at(current, new, now_ns, before)
        if retry_ns is not None and self.num_reserved < self.max_reservations:
            new.reserved_from_ns, new.reserved_until_ns = retry_ns, retry_ns + self.reservation_grace_ns
            self.commitments[new.request_id] = new
        elif retry_ns is None:
            retry_ns = max(before.values(), default=now_ns)
        return Reject(retry_after_ms=max(math.ceil((retry_ns - now_ns) / NS_PER_MS), 1), predicted_finish_ns=finish_ns)

    def _check(self, new: Commitment, now_ns: int) -> tuple[bool, int, list[Commitment], dict[str, int]]:
        """Fits `new` with the admitted requests and with the reserved retries due before it would finish."""
        admitted = [c for c in self.commitments.values() if c.reserved_from_ns is None]
        before = self.predictor.finish_times(admitted, now_ns)
        ok, finish_ns = self.predictor.fits(admitted, new, now_ns, before)
        due = [c for c in self.commitments.values()
               if c.reserved_from_ns is not None and c.reserved_from_ns < finish_ns]
        if not due:
            return ok, finish_ns, admitted, before
        current = admitted + due
        before = self.predictor.finish_times(current, now_ns)
        ok, finish_ns = self.predictor.fits(current, new, now_ns, before)
        return ok, finish_ns, current, before

    def _retry_at(self, current: list[Commitment], new: Commitment, now_ns: int,
                  before: dict[str, int]) -> int | None:
        """Earliest predicted finish of a running request after which `new` would be admitted, if any."""
        by_finish = sorted(current, key=lambda c: before[c.request_id])
        for k, leaving in enumerate(by_finish):
            at_ns = before[leaving.request_id]
            if at_ns >= new.deadline_ns:
                return None
            steps_done = leaving.num_remaining_tokens
            rest = [Commitment(c.request_id, c.num_prompt_tokens, c.max_tokens, c.deadline_ns,
                               min(c.num_generated + steps_done, c.max_tokens))
                    for c in by_finish[k + 1:]]
            later_before = self.predictor.finish_times(rest, at_ns)
            if self.predictor.fits(rest, new, at_ns, later_before)[0]:
                return at_ns
        return None

    def on_progress(self, request_id: str, num_generated: int) -> None:
        c = self.commitments.get(request_id)
        if c is not None:
            c.num_generated = num_generated

    def release(self, request_id: str) -> None:
        c = self.commitments.get(request_id)
        if c is not None and c.reserved_from_ns is None:
            del self.commitments[request_id]

    def _expire_reservations(self, now_ns: int) -> None:
        for request_id in [r for r, c in self.commitments.items()
                           if c.reserved_until_ns is not None and c.reserved_until_ns <= now_ns]:
            del self.commitments[request_id]


class FifoAdmission:
    """The conventional server: admit everything, let the engine's queue grow without bound."""

    def __init__(self) -> None:
        self.commitments: dict[str, Commitment] = {}

    @property
    def num_admitted(self) -> int:
        return len(self.commitments)

    def decide(self, new: Commitment, now_ns: int) -> Decision:
        self.commitments[new.request_id] = new
        return Admit(predicted_finish_ns=0)

    def on_progress(self, request_id: str, num_generated: int) -> None:
        pass

    def release(self, request_id: str) -> None:
        self.commitments.pop(request_id, None)
