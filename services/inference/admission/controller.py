"""Deadline admission at arrival: admit only what the cost model predicts finishes inside its deadline. No torch.

Runs on the event loop thread, which owns the set of commitments (admitted calls and reserved retries).
Progress comes back from the token streams; the prediction is predictor.py's, the checks checks.py's, and what
a refused call is promised refusals.py's.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..cost.model import CostModel
from .checks import Arrival, Calendar, Scene, ahead_of_later, infeasible, kept_for_others
from .decisions import AdmissionConfig, Admit, Commitment, Decision, Infeasible, RefusalCause, Reject
from .estimators import Estimators
from .interface import FreeBlocks
from .predictor import step_in_flight
from .refusals import Promises
from .settings import DEFAULT_SETTINGS, AdmissionSettings


class AdmissionController:
    """Deadline mode, an `Admission` (interface.py): predict at arrival; admit, or reject at once with the time
    capacity frees for the call and a reservation of a slot from then, so the hinted retry finds room (refusals.py
    says what is promised). Tenants' fair share and class priority keep headroom (headroom.py) unless `fair` is off:
    first come, the comparison of old. `kv`: the paged KV pool, where it has fewer blocks than the slots could fill
    (else None): its blocks are planned on the calendar beside the slots, each call's `num_blocks`."""

    predicts = True

    def __init__(
        self,
        cost: CostModel,
        config: AdmissionConfig,
        settings: AdmissionSettings = DEFAULT_SETTINGS,
        weights: Mapping[str, float] | None = None,
        kv: FreeBlocks | None = None,
    ) -> None:
        self.settings = settings
        self.kv = kv
        self.config = config
        self.estimators = by = Estimators.build(cost, config, settings, weights)
        self.predictor, self.idle, self.lateness = by.predictor, by.idle, by.lateness
        self.shares, self.priorities = by.shares, by.priorities
        self.calendar = Calendar(by.predictor, by.lateness, config.num_slots, settings.max_retry_candidates)
        self.promises = Promises(settings, by)
        # the promises' state, read by the metrics (events) and the tests
        self.commitments, self.turns, self.events = self.promises.commitments, self.promises.turns, self.promises.events
        self.saturations = self.promises.saturations
        # when the step the engine runs now began: the last step's end, or the moment a call joined an idle engine
        self._step_began_ns = 0

    @property
    def fair(self) -> bool:
        """Fair share and class priority keep headroom (headroom.py); off: first come, the comparison of old."""
        return self.estimators.fair

    @fair.setter
    def fair(self, fair: bool) -> None:
        self.estimators.fair = fair

    @property
    def num_admitted(self) -> int:
        return sum(1 for c in self.commitments.values() if not c.is_reservation)

    @property
    def num_reserved(self) -> int:
        return self.promises.num_reserved

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """The tenants' weights as the replica's serving policy now says (1 for a tenant not named)."""
        self.shares.set_weights(weights)

    def decide(self, new: Commitment, now_ns: int) -> Decision:
        call = self.promises.arrive(new, now_ns)
        first = new.attempt == 0 and not call.on_time
        self.shares.arrive(new.tenant, now_ns, first)
        decision = self._decide(call)
        if isinstance(decision, Admit):
            self._joins(new, decision.start_ns or now_ns, now_ns)
        if not isinstance(decision, Infeasible):  # a call no idle replica could serve in time needs no headroom
            self.priorities.arrive(new, now_ns, first)
        if isinstance(decision, Admit):  # its slot's expected hold: the prediction, as late as calls really finish
            hold_ns = int((decision.predicted_finish_ns - (decision.start_ns or now_ns)) * self.lateness.mean)
            self.shares.admit(new.tenant, hold_ns)
            self.priorities.admit(new.priority, hold_ns)
        if first and not isinstance(decision, Infeasible):
            self.promises.saturation(new.tenant).observe(isinstance(decision, Reject), now_ns)
        if call.on_time:
            self.events["taken" if isinstance(decision, Admit) else "taken_refused"] += 1
        return decision

    def step_ended(self, ended_ns: int) -> None:
        """The engine ended a step at `ended_ns` (its clock) and, busy, began the next. Called by the step
        observer, on the engine's thread when the engine runs on one: a single int written, read on the loop."""
        self._step_began_ns = ended_ns

    def _joins(self, c: Commitment, at_ns: int, now_ns: int) -> None:
        """`c` may join a step from `at_ns`; an idle engine begins one at once (a held call's later start is
        the service's to hand over, and no step is known to begin then)."""
        c.admitted_ns = at_ns
        if at_ns <= now_ns and self.predictor.step_end_ns == 0:  # no step in flight when it was decided: idle
            self._step_began_ns = max(self._step_began_ns, at_ns)

    def _step_in_flight(self, now_ns: int) -> tuple[int, dict[str, int]]:
        return step_in_flight(self.predictor, self.commitments.values(), self._step_began_ns, now_ns)

    def _decide(self, call: Arrival) -> Decision:
        """The checks in their order (checks.py), then the outcome (refusals.py)."""
        new, now_ns = call.new, call.now_ns
        self.promises.keep_waiting_in_time(now_ns)
        # 1. feasible at all: an idle replica would finish it inside its budget
        if (never := infeasible(self.idle, new, now_ns)) is not None:
            return never
        running = [c for c in self.commitments.values() if c.reserved_from_ns is None]
        # the step the engine runs now: a call decided during it joins only the step after it
        self.predictor.step_end_ns, self.predictor.in_flight_rows = self._step_in_flight(now_ns)
        finishes = self.predictor.finish_times(running, now_ns)
        # 2. headroom kept for others: free slots, room in time and in the next step, for tenants and classes
        room = self.estimators.headroom(call)
        holding = self.estimators.holding_against(new, room, self.promises.reservations())
        now = Scene(now_ns, running, finishes, holding, free_blocks=None if self.kv is None else self.kv.num_free)
        if room.num_slots and (cause := kept_for_others(room, self.config.num_slots, now)):
            finish_ns = self.predictor.finish_times([*running, new], now_ns)[new.key]
            return self.promises.refuse_for_headroom(call, finishes, finish_ns, cause)
        # 3. fits now beside the running calls and the headroom in time: a slot for its whole run, deadlines met
        beside = self.calendar.with_headroom(now, room)
        why, finish_ns = self.calendar.fits_at(new, beside, ahead_of_later_reservations=call.on_time)
        # 4. admit (if its prompt finds room in the next steps), or hold it for a slot inside its slack, or refuse
        # it, with or without a reservation
        if why is None:
            return self.promises.admit(call, running + list(room.prompts), finish_ns)
        if room.for_classes and self.calendar.fits_beside_tenants(new, now, room):
            return self.promises.refuse_for_headroom(call, finishes, finish_ns, RefusalCause.PRIORITY)
        slack = self.promises.slack_runs(new.tenant, now_ns)
        retry = self.calendar.earliest_retry(new, beside, slack)
        blocks_now = self._blocks_free_now(call, beside, retry)
        return self.promises.refuse(call, beside.finishes, retry, why, finish_ns, blocks_now)

    def _blocks_free_now(self, call: Arrival, now: Scene, retry: tuple[int, int] | None) -> bool:
        """Whether `call`, admitted now to join the engine and wait there for the slot that frees at `retry` (a
        retry on time whose slot frees a little late), finds its KV blocks free from now until that run's end:
        such a call takes them at once. Always, where blocks are not planned."""
        if retry is None or now.free_blocks is None:
            return True
        ahead = ahead_of_later(now.reservations, now.at_ns) if call.on_time else None
        return not self.calendar.blocks_short(call.new, now, self.lateness.stretch(*retry), ahead)

    def started(self, key: str) -> None:
        c = self.commitments.get(key)
        if c is not None and c.is_waiting:
            self.promises.begun(c)

    def observe_finish(self, predicted_ns: int, actual_ns: int) -> None:
        """A call admitted with `predicted_ns` to go took `actual_ns`."""
        self.lateness.observe(predicted_ns, actual_ns)

    def on_progress(self, key: str, num_generated: int) -> None:
        c = self.commitments.get(key)
        if c is not None:
            c.num_generated = num_generated
            if c.is_waiting and num_generated:
                self.promises.begun(c)

    def due(self, now_ns: int) -> list[str]:
        """Held calls that may start now, in the order of their planned starts: a slot freed before it was
        predicted to, and each fits now beside the running calls as it would have at its start."""
        # past its planned start, a held call is the engine's already (the service sent it then)
        held = (c for c in self.commitments.values() if c.is_waiting and c.reserved_from_ns > now_ns)
        waiting = sorted(held, key=lambda c: c.reserved_from_ns)
        started: list[str] = []
        for c in waiting:
            running = [r for r in self.commitments.values() if r.reserved_from_ns is None]
            others = [r for r in self.promises.reservations() if r is not c]
            if self.calendar.full_at(now_ns, len(running), others):
                break
            self.predictor.step_end_ns, self.predictor.in_flight_rows = self._step_in_flight(now_ns)
            finishes = self.predictor.finish_times(running, now_ns)
            now = Scene(now_ns, running, finishes, others, free_blocks=None if self.kv is None else self.kv.num_free)
            why, finish_ns = self.calendar.fits_at(c, now)
            if why is not None:
                break  # in order: a later one starting first would take the slot planned for this one
            self.promises.start_now(c, now_ns, finish_ns)
            self._joins(c, now_ns, now_ns)
            started.append(c.key)
        return started

    def release(self, key: str) -> None:
        c = self.commitments.get(key)
        if c is not None and not c.is_reservation:
            del self.commitments[key]
            self.promises.waiting.discard(key)
            self.shares.release(c.tenant)
            self.priorities.release(c.priority)
            if self.num_admitted == 0:  # drained: a saturation verdict must not outlive the burst behind it
                for saturation in self.saturations.values():
                    saturation.relieve()
