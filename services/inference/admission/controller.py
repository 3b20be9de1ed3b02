"""Admission at arrival: admit only what the cost model predicts finishes inside its deadline. No torch.

Runs on the event loop thread, which owns the set of commitments (admitted requests and reserved retries).
Progress comes back from the token streams; the prediction is predictor.py's.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Mapping

from ..cost.model import CostModel
from .decisions import (
    DEADLINE,
    DELAYS_ADMITTED,
    NS_PER_MS,
    OVER_SHARE,
    PRIORITY,
    SLOTS_FULL,
    STEP_BUDGET,
    AdmissionConfig,
    Admit,
    Commitment,
    Decision,
    Infeasible,
    Reject,
)
from .follow import FollowThrough
from .headroom import NONE, Headroom, headroom, holding_against
from .lateness import Lateness
from .plan import from_their_time, progressed, steps_until_room
from .predictor import Predictor, peak_occupancy
from .priorities import Priorities
from .saturation import Saturation
from .shares import Shares


class AdmissionController:
    """Deadline mode: predict at arrival; admit, or reject at once with the time capacity frees for the call
    and a reservation of a slot from then, so the hinted retry finds room. Slots over time form a calendar:
    a running call holds one until its predicted finish, a reservation over its reserved interval.

    A reservation is a promise both ways: it waits `reservation_grace_ms` past its time for a retry that
    comes late, and a retry that comes on time while its slot (or the step's room for its prompt) is still
    taken, because the device ran slower than predicted, is admitted if that frees within `retry_hold_ms`
    and its deadline still holds: it joins the engine when the slot frees rather than being sent away
    again. The calendar counts it from its admission, so it is the one that takes that slot. A call refused
    only because the next step's token budget was taken holds no slot, but keeps its turn: its retry, on
    time, may wait up to `retry_hold_ms` for that room, where a newcomer would be refused."""

    max_retry_candidates = 8
    max_tenants = 1024  # tenants whose saturation is remembered
    # a retry is invited only to a time from which its predicted run leaves at least this much of the run again
    # spare in its budget: a call admitted with less holds back the prompts of every call admitted after it
    # (each one that joins lengthens its run), so near capacity it costs more goodput than it brings
    retry_slack = 1.0

    def __init__(
        self,
        cost: CostModel,
        config: AdmissionConfig,
        reservation_grace_ms: float = 50.0,
        max_reservations: int | None = None,
        retry_hold_ms: float = 50.0,
        weights: Mapping[str, float] | None = None,
        fair: bool = True,
    ) -> None:
        # a rejection storm must not grow the work of every decision: at most this many reservations
        self.max_reservations = config.num_slots if max_reservations is None else max_reservations
        self.predictor = Predictor(cost, config, max_batch=config.num_slots + self.max_reservations + 1)
        # "infeasible" says no idle replica could meet the budget: judged on the calibration as it was measured on
        # the idle device, never on the running ratio, which a loaded or slowed replica inflates
        calibrated = CostModel(
            list(cost.rows),
            list(cost.row_us),
            cost.us_per_context_token,
            num_deviations=cost.num_deviations,
            deviation=cost.deviation,
        )
        self.idle = Predictor(calibrated, config, max_batch=2)
        self.config = config
        self.commitments: dict[str, Commitment] = {}
        self.lateness = Lateness()
        self.follow = FollowThrough()
        # per tenant: a flood saturates its sender, not the modest tenant beside it (saturation.py)
        self.saturations: dict[str, Saturation] = {}
        self.new_saturation: Callable[[], Saturation] = Saturation
        # fair share between tenants and class priority (headroom.py); off: first come, the comparison of old
        self.fair = fair
        self.shares = Shares(config.num_slots, dict(weights or {}))
        self.priorities = Priorities(max_slots=config.num_slots // 4)
        self.reservation_grace_ns = int(reservation_grace_ms * NS_PER_MS)
        self.retry_hold_ns = int(retry_hold_ms * NS_PER_MS)
        self.turns: dict[str, int] = {}  # refused for the step budget: request_id -> when its turn lapses
        # what became of the promises to refused calls, by event (metrics.ReservationEvents lists them)
        self.events: Counter[str] = Counter()

    @property
    def num_admitted(self) -> int:
        return sum(1 for c in self.commitments.values() if not c.is_reservation)

    @property
    def num_reserved(self) -> int:
        return len(self.commitments) - self.num_admitted

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """The tenants' weights as the replica's serving policy now says (1 for a tenant not named)."""
        self.shares.set_weights(weights)

    def decide(self, new: Commitment, now_ns: int) -> Decision:
        self._expire_reservations(now_ns)
        held = self.commitments.get(new.request_id)
        on_time = held is not None and held.is_reservation
        if on_time:
            del self.commitments[new.request_id]  # a retry takes up its own reservation
            self.follow.observe(held.tenant, held.again, came=True)
        first = new.attempt == 0 and not on_time
        self.shares.arrive(new.tenant, now_ns, first)
        decision = self._decide(new, now_ns, on_time)
        if not isinstance(decision, Infeasible):  # a call no idle replica could serve in time needs no headroom
            self.priorities.arrive(new, now_ns, first)
        if isinstance(decision, Admit):  # its slot's expected hold: the prediction, as late as calls really finish
            hold_ns = int((decision.predicted_finish_ns - now_ns) * self.lateness.mean)
            self.shares.admit(new.tenant, hold_ns)
            self.priorities.admit(new.priority, hold_ns)
        if new.attempt == 0 and not on_time and not isinstance(decision, Infeasible):
            self._saturation(new.tenant).observe(isinstance(decision, Reject), now_ns)
        if on_time:
            self.events["taken" if isinstance(decision, Admit) else "taken_refused"] += 1
        return decision

    def _decide(self, new: Commitment, now_ns: int, on_time: bool) -> Decision:
        has_turn = on_time or self.turns.pop(new.request_id, None) is not None
        if has_turn and not on_time:
            self.events["turn_retry"] += 1
        idle = self.idle.finish_times([new], now_ns)[new.request_id]
        if idle > new.deadline_ns - self.idle.margin_for(new, now_ns):
            return Infeasible(min_budget_ms=math.ceil(self.config.min_budget_ns(idle - now_ns) / NS_PER_MS))
        running = [c for c in self.commitments.values() if c.reserved_from_ns is None]
        real_finishes = finishes = self.predictor.finish_times(running, now_ns)
        room = NONE if on_time or not self.fair else headroom(self.shares, self.priorities, new, now_ns)
        blocking = holding_against(new, room, self._reservations()) if self.fair else self._reservations()
        if room.num_slots and (cause := self._kept_cause(room, now_ns, len(running), blocking)):
            finish_ns = self.predictor.finish_times([*running, new], now_ns)[new.request_id]
            return self._headroom_refusal(new, now_ns, real_finishes, finish_ns, cause)
        admitted, before = running, None
        if room.phantoms:  # the headroom in time: the phantoms must still meet their deadlines, always
            admitted = running + list(room.phantoms)
            before = {**{p.request_id: 0 for p in room.phantoms}, **real_finishes}
            finishes = self.predictor.finish_times(admitted, now_ns)
        why, finish_ns = self._fits_at(new, now_ns, admitted, finishes, blocking, on_time, before=before)
        if why is None:
            return self._join(new, now_ns, running + list(room.prompts), finish_ns, has_turn)
        if room.for_classes and self._fits_beside_tenants(new, now_ns, running, real_finishes, room, blocking):
            return self._headroom_refusal(new, now_ns, real_finishes, finish_ns, PRIORITY)
        return self._refuse(new, now_ns, admitted, finishes, why, finish_ns, on_time, has_turn, blocking)

    def _join(
        self, new: Commitment, now_ns: int, admitted: list[Commitment], finish_ns: int, has_turn: bool
    ) -> Decision:
        """`new` fits: admitted if its prompt joins the very next step (or, holding its turn, within a step);
        else a short refusal that holds no slot, only its turn."""
        full_step_ns = int(self.predictor.cost.step_us(self.config.max_num_batched_tokens) * 1000)
        wait_ns = steps_until_room(admitted, self.config.max_num_batched_tokens) * full_step_ns
        # a retry that kept its turn may wait for prompts ahead: one full step, or retry_hold_ms if longer
        hold_ns = max(self.retry_hold_ns, full_step_ns)
        if wait_ns and not (has_turn and wait_ns <= hold_ns and finish_ns + wait_ns <= self._limit(new, now_ns)):
            if self._saturated_for(new.tenant, now_ns):
                return self._saturated(wait_ns, finish_ns, STEP_BUDGET)
            if held_turn := len(self.turns) < self.max_reservations:
                self.turns[new.request_id] = now_ns + wait_ns + self._grace_ns(wait_ns)
            self.events["turn_held" if held_turn else "unbacked"] += 1
            return Reject(_ms(wait_ns), finish_ns, reason=STEP_BUDGET, reserved=held_turn)
        self.commitments[new.request_id] = new
        return Admit(finish_ns + wait_ns)

    def _refuse(
        self,
        new: Commitment,
        now_ns: int,
        admitted: list[Commitment],
        finishes: dict[str, int],
        why: str,
        finish_ns: int,
        on_time: bool,
        has_turn: bool,
        blocking: list[Commitment],
    ) -> Decision:
        """`new` does not fit now: a refusal with the hint of its earliest retry, and a reservation for it when
        one is due; or, for a retry come for its reservation whose slot frees a little late, admission."""
        slack = 0.0 if self._lent(new.tenant, now_ns) else self.retry_slack
        retry = self._earliest_retry(new, now_ns, admitted, finishes, slack, blocking)
        if retry is None:
            return Reject(self._frees_ms(finishes, now_ns), finish_ns, within_budget=False, reason=why)
        at_ns, retry_finish_ns = retry
        if on_time and at_ns - now_ns <= self.retry_hold_ns:  # its slot frees a little late: held for it
            self.commitments[new.request_id] = new
            self.events["retry_held"] += 1
            return Admit(retry_finish_ns)
        if self._saturated_for(new.tenant, now_ns):
            return self._saturated(at_ns - now_ns, finish_ns, why)
        # at most max_reservations, so a storm cannot grow every decision's work: past that, a best guess; and
        # only for tenants whose refused calls have been coming back for their reservations
        again = has_turn or new.attempt > 0
        reserved = self.num_reserved < self.max_reservations and self.follow.expects(new.tenant, again)
        if reserved:
            new.reserved_from_ns, new.reserved_until_ns = at_ns, self.lateness.stretch(at_ns, retry_finish_ns)
            new.expires_ns = at_ns + self._grace_ns(at_ns - now_ns)
            new.again = again
            self.commitments[new.request_id] = new
        self.events["reserved" if reserved else "unbacked"] += 1
        return Reject(_ms(at_ns - now_ns), finish_ns, reason=why, reserved=reserved)

    def _frees_ms(self, finishes: dict[str, int], now_ns: int) -> int:
        """When the first slot frees, as slots really free (later than predicted): a hint for a fresh call."""
        frees_ns = min((self.lateness.stretch(now_ns, f) for f in finishes.values() if f > now_ns), default=now_ns)
        return _ms(frees_ns - now_ns)

    def _kept_cause(self, room: Headroom, now_ns: int, num_running: int, blocking: list[Commitment]) -> str | None:
        """Whether the free slot `new` would take is one kept in hand for others: for tenants that are modest or
        under their share (OVER_SHARE), else for a higher class (PRIORITY); None if it is not."""
        held = sum(1 for r in blocking if r.reserved_from_ns <= now_ns < r.reserved_until_ns)
        free_after = self.config.num_slots - num_running - held - 1
        if room.for_tenants and free_after < room.for_tenants:
            return OVER_SHARE
        return PRIORITY if 0 <= free_after < room.num_slots else None  # none free: slots full, as for anyone

    def _fits_beside_tenants(
        self,
        new: Commitment,
        now_ns: int,
        running: list[Commitment],
        running_finishes: dict[str, int],
        room: Headroom,
        blocking: list[Commitment],
    ) -> bool:
        """`new` would fit now if it left room only for other tenants: the headroom of a higher class refused it.
        `running_finishes`: the running calls' predicted finishes, without phantoms (the decision has them)."""
        tenants = running + list(room.phantoms[: room.num_tenant_phantoms])
        before = {**{p.request_id: 0 for p in tenants[len(running) :]}, **running_finishes}
        finishes = self.predictor.finish_times(tenants, now_ns)
        return self._fits_at(new, now_ns, tenants, finishes, blocking, before=before)[0] is None

    def _headroom_refusal(
        self, new: Commitment, now_ns: int, finishes: dict[str, int], finish_ns: int, cause: str
    ) -> Reject:
        """Refused for headroom kept for others: no reservation (its retry would take that headroom). OVER_SHARE
        invites no retry here; PRIORITY hints when a slot frees, inside the call's budget if its run still fits
        then and its tenant is not saturated (a saturated replica invites no retry, saturation.py)."""
        frees_ms = self._frees_ms(finishes, now_ns)
        if cause == PRIORITY and self._saturated_for(new.tenant, now_ns):
            return self._saturated(frees_ms * NS_PER_MS, finish_ns, cause)
        within = cause == PRIORITY and finish_ns + frees_ms * NS_PER_MS <= self._limit(new, now_ns)
        return Reject(frees_ms, finish_ns, within_budget=within, reason=cause)

    def _saturated_for(self, tenant: str, now_ns: int) -> bool:
        """No retry is invited here for `tenant`: it has been refused most of the time lately, and it is not a
        tenant under its share whose slots others have borrowed (for it, a retry takes back what was lent)."""
        return self._saturation(tenant).saturated and not self._lent(tenant, now_ns)

    def _lent(self, tenant: str, now_ns: int) -> bool:
        """In fair mode, slots of `tenant`'s share are lent to another tenant (shares.py)."""
        return self.fair and self.shares.lent_to_others(tenant, now_ns)

    def _saturation(self, tenant: str) -> Saturation:
        saturation = self.saturations.pop(tenant, None) or self.new_saturation()
        self.saturations[tenant] = saturation  # the most recent last: the oldest go first past the bound
        if len(self.saturations) > self.max_tenants:
            del self.saturations[next(iter(self.saturations))]
        return saturation

    def _saturated(self, wait_ns: int, finish_ns: int, why: str) -> Reject:
        """A refusal that invites no retry here: on a saturated replica a retry would only take another call's
        place (saturation.py). The hint still says when room frees, for a client with other replicas."""
        self.events["saturated"] += 1
        return Reject(_ms(wait_ns), finish_ns, within_budget=False, reason=why, saturated=True)

    def _grace_ns(self, wait_ns: int) -> int:
        """How long past its hinted time a refused call's reservation or turn waits for its retry."""
        return max(self.reservation_grace_ns, wait_ns // 10)

    def _fits_at(
        self,
        new: Commitment,
        at_ns: int,
        admitted: list[Commitment],
        finishes: dict[str, int],
        reservations: list[Commitment],
        ahead_of_later_reservations: bool = False,
        finish_unused: bool = False,
        before: dict[str, int] | None = None,
    ) -> tuple[str | None, int]:
        """None if `new` joining at `at_ns` meets every deadline and finds a free slot for its whole run, else
        why not (SLOTS_FULL, DEADLINE, DELAYS_ADMITTED); and `new`'s predicted finish from then.
        `admitted` are the running calls as they will be at `at_ns`, `finishes` their finishes from then.
        A retry that comes for its reservation goes ahead of reservations due after it: they were planned
        behind it, on predictions that have since moved, so they wait (or are refused) rather than it.
        `reservations` are those that hold their slots against `new`. `before`: the finishes `admitted` were
        predicted to meet before `new` (default `finishes`; 0 for a phantom of headroom, always kept).
        With `finish_unused`, a no may come with 0 for the finish, before any prediction."""
        if ahead_of_later_reservations:
            reservations = [r for r in reservations if r.reserved_from_ns <= at_ns]
        # slots free when calls really finish, which is later than predicted
        stretch = self.lateness.stretch
        intervals = [(at_ns, stretch(at_ns, finishes[c.request_id])) for c in admitted]
        intervals += [(r.reserved_from_ns, r.reserved_until_ns) for r in reservations]
        if finish_unused:  # the calendar is full before even the shortest run `new` could have ends: a quick no
            shortest_ns = self.lateness.stretch(at_ns, self.predictor.earliest_finish(new, at_ns))
            if peak_occupancy(intervals, at_ns, shortest_ns) >= self.config.num_slots:
                return SLOTS_FULL, 0
        if self._full_at(at_ns, sum(1 for f in finishes.values() if f > at_ns), reservations):
            if finish_unused:
                return SLOTS_FULL, 0
            return SLOTS_FULL, self.predictor.finish_times([*admitted, new], at_ns)[new.request_id]
        ok, finish_ns = self.predictor.meets_deadlines(admitted, new, at_ns, finishes if before is None else before)
        due = [r for r in reservations if r.reserved_from_ns < finish_ns and r.reserved_until_ns > at_ns]
        if ok and due:  # retries arriving during the run share its steps: count them as running too
            due = from_their_time(self.predictor, due, at_ns, len(admitted) + len(due) + 1)
            with_due = self.predictor.finish_times(admitted + due, at_ns)
            ok, finish_ns = self.predictor.meets_deadlines(
                admitted + due, new, at_ns, with_due if before is None else {**with_due, **before}
            )
        holds_until = self.lateness.stretch(at_ns, finish_ns)
        # slots before deadlines, as the quick answers above (finish_unused: no reason wanted, no count after a no)
        if (ok or not finish_unused) and peak_occupancy(intervals, at_ns, holds_until) >= self.config.num_slots:
            return SLOTS_FULL, finish_ns
        if not ok:  # meets_deadlines said no, for its own deadline or for another's
            return (DEADLINE if finish_ns > self._limit(new, at_ns) else DELAYS_ADMITTED), finish_ns
        return None, finish_ns

    def _limit(self, c: Commitment, at_ns: int) -> int:
        """The latest predicted finish `c` is admitted with: its deadline less the safety margin."""
        return c.deadline_ns - self.predictor.margin_for(c, at_ns)

    def _reservations(self) -> list[Commitment]:
        return [c for c in self.commitments.values() if c.reserved_from_ns is not None]

    def _full_at(self, at_ns: int, num_running: int, reservations: list[Commitment]) -> bool:
        """No slot free at the instant `at_ns`: a quick no, before the cost of any prediction (the calendar's
        peak over a run is at least its occupancy at the run's start)."""
        held = sum(1 for r in reservations if r.reserved_from_ns <= at_ns < r.reserved_until_ns)
        return num_running + held >= self.config.num_slots

    def _earliest_retry(
        self,
        new: Commitment,
        now_ns: int,
        admitted: list[Commitment],
        finishes: dict[str, int],
        slack: float,
        reservations: list[Commitment],
    ) -> tuple[int, int] | None:
        """The first moment a slot frees (a call finishes or a reservation ends) from which `new` would be
        admitted inside its own deadline, with its predicted finish from then; None if there is none."""
        slot_ends = {rid: self.lateness.stretch(now_ns, f) for rid, f in finishes.items()}
        frees = {f for f in slot_ends.values() if f > now_ns} | {r.reserved_until_ns for r in reservations}
        # a running call still holds its slot at a candidate time iff it is predicted to end after it and has
        # tokens left (progressed leaves it short of max_tokens then): counted before copying anything
        holding = sorted(slot_ends[c.request_id] for c in admitted if c.num_generated < c.max_tokens)
        for at_ns in sorted(frees)[: self.max_retry_candidates]:
            if at_ns >= new.deadline_ns:
                break
            if self._full_at(at_ns, len(holding) - bisect.bisect_right(holding, at_ns), reservations):
                continue
            later = progressed(admitted, slot_ends, now_ns, at_ns)
            why, finish_ns = self._fits_at(
                new, at_ns, later, self.predictor.finish_times(later, at_ns), reservations, finish_unused=True
            )
            if why is None and finish_ns + slack * (finish_ns - at_ns) <= self._limit(new, at_ns):
                return at_ns, finish_ns
        return None

    def observe_finish(self, predicted_ns: int, actual_ns: int) -> None:
        """A call admitted with `predicted_ns` to go took `actual_ns`."""
        self.lateness.observe(predicted_ns, actual_ns)

    def on_progress(self, request_id: str, num_generated: int) -> None:
        c = self.commitments.get(request_id)
        if c is not None:
            c.num_generated = num_generated

    def release(self, request_id: str) -> None:
        c = self.commitments.get(request_id)
        if c is not None and not c.is_reservation:
            del self.commitments[request_id]
            self.shares.release(c.tenant)
            self.priorities.release(c.priority)

    def _expire_reservations(self, now_ns: int) -> None:
        for request_id in [r for r, c in self.commitments.items() if c.is_reservation and c.expires_ns <= now_ns]:
            lapsed = self.commitments.pop(request_id)
            self.follow.observe(lapsed.tenant, lapsed.again, came=False)
            self.events["lapsed"] += 1
        for request_id in [r for r, expires_ns in self.turns.items() if expires_ns <= now_ns]:
            del self.turns[request_id]
            self.events["turn_lapsed"] += 1


def _ms(ns: int) -> int:
    return max(math.ceil(ns / NS_PER_MS), 1)
