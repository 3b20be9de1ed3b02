"""The last step of a decision, once the checks (checks.py) have said whether a call fits: admit it, hold it for a
slot that frees inside its slack, or refuse it with a hint of when to retry, and with or without a promise that
the retry finds room. No torch.

Every refusal of admission is built here, each with its cause (RefusalCause): the checks decide the cause, these
decide what is promised with it. A promise is a reservation of a slot from the hinted time (SLOTS_FULL, DEADLINE,
DELAYS_ADMITTED) or a held turn in the step's token budget (STEP_BUDGET); a refusal for headroom kept for others
(OVER_SHARE, PRIORITY) promises nothing, since its retry would take that headroom. No reservation is made for a
tenant whose retries have not been coming back (`FollowThrough`: history.py).

Where its tenant is saturated (`Saturation`), a replica with others beside it (`AdmissionSettings.elsewhere`)
invites no retry to itself and points it at them. A replica alone is its callers' only one: there saturation
invites the retry only with a promise (a reservation, a held turn or, with holds, a held call), and where none can
be made it invites none, saying that there is no other replica to try."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

from .checks import Arrival, limit
from .decisions import NS_PER_MS, Admit, Commitment, Decision, RefusalCause, Reject
from .estimators import Estimators
from .history import FollowThrough, Saturation
from .predictor import steps_until_room
from .settings import AdmissionSettings


class Promises:
    """The calendar's commitments (admitted calls and reserved retries) and the turns held, with what became of
    each promise (`events`, by event: metrics.ReservationEvents lists them).

    A reservation is a promise both ways: it waits `reservation_grace_ms` past its time for a retry that comes
    late, and a retry that comes on time while its slot (or the step's room for its prompt) is still taken,
    because the device ran slower than predicted, is admitted if that frees within `retry_hold_ms` and its
    deadline still holds; where its slot frees later, inside its budget, it is admitted and held for that slot.
    A call refused only because the next step's token budget was taken holds no slot, but keeps its turn: its
    retry, on time, may wait up to `retry_hold_ms` for that room."""

    def __init__(self, settings: AdmissionSettings, judged_with: Estimators) -> None:
        self.by = judged_with
        self.settings = settings
        # a rejection storm must not grow the work of every decision: at most this many reservations
        self.max_reservations = settings.max_reservations_for(judged_with.config.num_slots)
        self.reservation_grace_ns = int(settings.reservation_grace_ms * NS_PER_MS)
        self.retry_hold_ns = int(settings.retry_hold_ms * NS_PER_MS)
        self.commitments: dict[str, Commitment] = {}  # admission key -> its admitted call or reserved retry
        self.turns: dict[str, int] = {}  # refused for the step budget: admission key -> when its turn lapses
        self.waiting: set[str] = set()  # admission keys of held calls that have not begun (`Commitment.is_waiting`)
        self.events: Counter[str] = Counter()
        self.elsewhere = settings.elsewhere  # other replicas serve the same model: saturation points at them
        s = settings
        # the latest lapsed reservations' admission keys, so that a retry that comes after its reservation lapsed
        # is told apart from one that never comes (`retry_after_lapse`: a client that retries late, loaded or far)
        self.lapsed: dict[str, None] = {}
        self.follow = FollowThrough(s.follow_alpha, s.follow_threshold_share, s.follow_explore_every, s.max_tenants)
        # per tenant: a flood saturates its sender, not the modest tenant beside it (`Saturation` in history.py)
        self.saturations: dict[str, Saturation] = {}
        self.new_saturation: Callable[[], Saturation] = lambda: Saturation(
            s.saturation_half_life_s,
            s.saturation_enter_share,
            s.saturation_leave_share,
            s.saturation_min_attempts,
            s.saturation_hold_s,
        )

    @property
    def num_reserved(self) -> int:
        return sum(1 for c in self.commitments.values() if c.is_reservation)

    def reservations(self) -> list[Commitment]:
        return [c for c in self.commitments.values() if c.reserved_from_ns is not None]

    def arrive(self, new: Commitment, now_ns: int) -> Arrival:
        """`new` arrives: lapsed promises go, and a retry takes up its own reservation, or its held turn."""
        self._expire(now_ns)
        kept = self.commitments.get(new.key)
        on_time = kept is not None and kept.is_reservation
        if on_time:
            del self.commitments[new.key]
            self.follow.observe(kept.tenant, kept.again, came=True)
        has_turn = on_time or self.turns.pop(new.key, None) is not None
        if has_turn and not on_time:
            self.events["turn_retry"] += 1
        if not on_time and self.lapsed and new.key in self.lapsed:
            del self.lapsed[new.key]
            self.events["retry_after_lapse"] += 1
        return Arrival(new, now_ns, on_time, has_turn)

    def admit(self, call: Arrival, admitted: list[Commitment], finish_ns: int) -> Decision:
        """`call` fits: admitted if its prompt joins the very next step (or, holding its turn, within a step), or
        behind the prompts ahead of it where it still finishes in time (`hold_for_prompts`, the default); else
        refused for the step budget, holding no slot, only its turn."""
        new, now_ns = call.new, call.now_ns
        room_ns, late_ns = self._prompt_wait(admitted)
        # a retry that kept its turn may wait for prompts ahead: one full step, or retry_hold_ms if longer
        turn_late_ns = room_ns if self.settings.hold_in_slack else late_ns  # full steps: `_prompt_wait`
        turn = (
            call.has_turn
            and room_ns <= max(self.retry_hold_ns, self._full_step_ns())
            and finish_ns + turn_late_ns <= limit(self.by.predictor, new, now_ns)
        )
        if room_ns and not (turn or self._holds_for_prompts(new, now_ns, room_ns, finish_ns + late_ns)):
            held_turn = len(self.turns) < self.max_reservations
            # saturated: alone, only a turn held with room to spare is invited; with others beside it, none
            if self.saturated_for(new.tenant, now_ns) and (
                self.elsewhere or not (held_turn and self._spares_runs(new, now_ns, late_ns, finish_ns))
            ):
                return self._saturated(room_ns, finish_ns, RefusalCause.STEP_BUDGET)
            if held_turn:
                self.turns[new.key] = now_ns + room_ns + self._grace_ns(room_ns)
            self.events["turn_held" if held_turn else "unbacked"] += 1
            return Reject(
                _ms(room_ns), finish_ns, reason=RefusalCause.STEP_BUDGET, reserved=held_turn, elsewhere=self.elsewhere
            )
        self.commitments[new.key] = new
        if room_ns and not turn:
            self.events["held_for_prompts"] += 1
        return Admit(finish_ns + late_ns)

    def _full_step_ns(self) -> int:
        return int(self.by.predictor.cost.step_us(self.by.config.max_num_batched_tokens) * 1000)

    def _prompt_wait(self, admitted: list[Commitment]) -> tuple[int, int]:
        """For a prompt behind those of `admitted` not yet run: how long until the step's token budget has room
        for it (whole steps, each full), and how much later than predicted that makes it finish. Its predicted
        finish already pays for every prompt ahead of it (finish_times charges each prompt's chunks to every
        call); what it leaves out is the rest of each step it waits through, the running batch's own step,
        which brings it no token. With `hold_in_slack`, a retry come back for its held turn, admitted with no spare
        run (`admit`), pays full steps for its wait: priced at the batch's step, 2 such calls of a flood beside a
        modest tenant missed (test_hold.py, seed 1)."""
        num_steps = steps_until_room(admitted, self.by.config.max_num_batched_tokens)
        if not num_steps:
            return 0, 0
        room_ns = num_steps * self._full_step_ns()
        context = sum(c.num_prompt_tokens + c.num_generated for c in admitted)
        batch_step_us = self.by.predictor.cost.step_us(len(admitted) + 1, context)
        return room_ns, num_steps * int(batch_step_us * 1000)

    def refuse(
        self,
        call: Arrival,
        finishes: dict[str, int],
        retry: tuple[int, int] | None,
        why: RefusalCause,
        finish_ns: int,
        blocks_now: bool = True,
    ) -> Decision:
        """`call` does not fit now (`why`): a refusal with the hint of its earliest `retry` (its time and its
        predicted finish from then; None: none inside its budget), and a reservation for it when one is due; or,
        for a retry come for its reservation whose slot frees a little late, admission. Saturated, a replica alone
        invites the retry only with its reservation (or holds the call), one with others beside it never. `blocks_now`:
        whether its KV blocks are free from now, where blocks are planned (a held call takes them at its start, a
        call admitted to wait in the engine for its slot at once)."""
        new, now_ns = call.new, call.now_ns
        if retry is None:
            frees_ms = self._frees_ms(finishes, now_ns)
            return Reject(frees_ms, finish_ns, within_budget=False, reason=why, elsewhere=self.elsewhere)
        at_ns, retry_finish_ns = retry
        # its slot frees a little late: held for it; never where joining now would push an admitted call late
        if blocks_now and call.on_time and why == RefusalCause.SLOTS_FULL and at_ns - now_ns <= self.retry_hold_ns:
            self.commitments[new.key] = new
            self.events["retry_held"] += 1
            return Admit(retry_finish_ns)
        saturated = self.saturated_for(new.tenant, now_ns)
        if saturated and self.elsewhere:
            return self._saturated(at_ns - now_ns, finish_ns, why)
        # later than that, or where joining now would push a running call late: held for the slot that frees inside
        # its budget, as a held call is, rather than refused. Its caller came back when told to, and the calendar's
        # plan for its slot moved (runs ended later than the lateness stretch allowed for; calls planned since took
        # the slot first): a refusal now would break the promise its hint made
        if call.on_time:
            return self.hold(new, at_ns, retry_finish_ns, event="retry_held_later")
        if self.settings.hold_in_slack:  # `retry` left the held calls' slack (slack_runs): hold it for that slot
            return self.hold(new, at_ns, retry_finish_ns)
        if why == RefusalCause.KV_BLOCKS and self.settings.hold_for_blocks:  # held for the blocks' return
            return self.hold(new, at_ns, retry_finish_ns, event="held_for_blocks")
        # at most max_reservations, so a storm cannot grow every decision's work: past that, a best guess; and
        # only for tenants whose refused calls have been coming back for their reservations
        again = call.has_turn or new.attempt > 0
        reserved = self.num_reserved < self.max_reservations and self.follow.expects(new.tenant, again)
        if reserved:
            new.reserved_from_ns, new.reserved_until_ns = at_ns, self.by.lateness.stretch(at_ns, retry_finish_ns)
            new.expires_ns = at_ns + self._grace_ns(at_ns - now_ns)
            new.again = again
            self.commitments[new.key] = new
        elif saturated:  # alone, and no slot can be promised: the capacity is not free, so no retry is invited
            return self._saturated(at_ns - now_ns, finish_ns, why)
        self.events["reserved" if reserved else "unbacked"] += 1
        return Reject(_ms(at_ns - now_ns), finish_ns, reason=why, reserved=reserved, elsewhere=self.elsewhere)

    def hold(self, new: Commitment, at_ns: int, finish_ns: int, event: str = "held") -> Admit:
        """`new` admitted, held for the slot predicted to free at `at_ns` (inside its slack, as `earliest_retry`
        found it): the calendar keeps that slot for it as for a reservation, and the service hands it to the engine
        then, or sooner when a slot frees early (`AdmissionController.due`); once its request has begun (`begun`)
        it is a running call like any other."""
        new.held = True
        new.reserved_from_ns, new.reserved_until_ns = at_ns, self.by.lateness.stretch(at_ns, finish_ns)
        self.commitments[new.key] = new
        self.waiting.add(new.key)
        self.events[event] += 1
        return Admit(finish_ns, start_ns=at_ns)

    def slack_runs(self, tenant: str, now_ns: int) -> float:
        """How many runs again a later start must leave spare in a call's budget: `retry_slack_runs` for a client's
        retry (none for a tenant whose slots others have borrowed: its retry takes back what was lent); with holds,
        never less than `hold_slack_runs`, since the start is the replica's own plan; saturated and alone, never less
        than `saturated_retry_slack_runs`, since there runs take longer than predicted."""
        s, lent = self.settings, self.by.lent(tenant, now_ns)
        runs = 0.0 if lent else s.retry_slack_runs
        runs = max(runs, s.hold_slack_runs) if s.hold_in_slack else runs
        # saturated_for, without asking again whether the tenant's slots are lent: a refusal's hot path
        alone_and_saturated = not self.elsewhere and not lent and self.saturation(tenant).saturated
        return max(runs, s.saturated_retry_slack_runs) if alone_and_saturated else runs

    def _spares_runs(self, new: Commitment, now_ns: int, late_ns: int, finish_ns: int) -> bool:
        """Saturated and alone: whether `new`'s run, finishing `late_ns` later than `finish_ns` for the steps its
        prompt waits, leaves `saturated_retry_slack_runs` of itself spare in its budget."""
        end_ns = finish_ns + late_ns + self.settings.saturated_retry_slack_runs * (finish_ns - now_ns)
        return end_ns <= limit(self.by.predictor, new, now_ns)

    def _holds_for_prompts(self, new: Commitment, now_ns: int, room_ns: int, end_ns: int) -> bool:
        """A call whose prompt waits `room_ns` for room in the step budget, predicted to finish at `end_ns`, is
        admitted now if its run from then leaves `hold_slack_runs` of itself spare (a start planned ahead is
        predicted without the calls that join beside it meanwhile); not on a saturated replica with others beside
        it, where the steps it would wait are every admitted call's (each prompt ahead of it is a call that came
        first) and the call has another replica to go to; on one alone, only if it leaves
        `saturated_retry_slack_runs` spare. Done with `hold_for_prompts` or `hold_in_slack`."""
        if not (self.settings.hold_for_prompts or self.settings.hold_in_slack):
            return False
        saturated = self.saturated_for(new.tenant, now_ns)
        if saturated and self.elsewhere:
            return False
        runs = self.settings.saturated_retry_slack_runs if saturated else self.settings.hold_slack_runs
        start_ns = now_ns + room_ns
        return end_ns + runs * max(end_ns - start_ns, 0) <= limit(self.by.predictor, new, start_ns)

    def keep_waiting_in_time(self, now_ns: int) -> None:
        """A held call past its start that has not begun waits for a slot that frees late (the device ran slower
        than predicted): its window moves with it, so the calendar does not free its slot early."""
        for key in self.waiting:  # the held calls only: no walk over the commitments on every decision
            c = self.commitments.get(key)
            if c is not None and c.is_waiting and c.reserved_from_ns < now_ns:
                c.reserved_until_ns += now_ns - c.reserved_from_ns
                c.reserved_from_ns = now_ns

    def start_now(self, c: Commitment, now_ns: int, finish_ns: int) -> None:
        """The held call `c` starts now rather than at its planned start (`AdmissionController.due`)."""
        c.reserved_from_ns, c.reserved_until_ns = now_ns, self.by.lateness.stretch(now_ns, finish_ns)
        self.events["held_started_early"] += 1

    def begun(self, c: Commitment) -> None:
        """The held call `c` has begun in the engine (its first token came back): its window is its run now."""
        c.reserved_from_ns = c.reserved_until_ns = None
        self.waiting.discard(c.key)

    def refuse_for_headroom(
        self, call: Arrival, finishes: dict[str, int], finish_ns: int, cause: RefusalCause
    ) -> Reject:
        """Refused for headroom kept for others: no reservation (its retry would take that headroom). OVER_SHARE
        invites no retry here; PRIORITY hints when a slot frees, inside the call's budget if its run still fits
        then and its tenant is not saturated (a saturated replica invites no retry it cannot promise a slot, and
        this one is headroom kept for others, alone or not: `Saturation`)."""
        new, now_ns = call.new, call.now_ns
        frees_ms = self._frees_ms(finishes, now_ns)
        if cause == RefusalCause.PRIORITY and self.saturated_for(new.tenant, now_ns):
            return self._saturated(frees_ms * NS_PER_MS, finish_ns, cause)
        fits_then = finish_ns + frees_ms * NS_PER_MS <= limit(self.by.predictor, new, now_ns)
        within_budget = cause == RefusalCause.PRIORITY and fits_then
        return Reject(frees_ms, finish_ns, within_budget=within_budget, reason=cause, elsewhere=self.elsewhere)

    def saturation(self, tenant: str) -> Saturation:
        saturation = self.saturations.pop(tenant, None) or self.new_saturation()
        self.saturations[tenant] = saturation  # the most recent last: the oldest go first past the bound
        if len(self.saturations) > self.settings.max_tenants:
            del self.saturations[next(iter(self.saturations))]
        return saturation

    def saturated_for(self, tenant: str, now_ns: int) -> bool:
        """No retry is invited here for `tenant` without a promise (none at all with `elsewhere`): it has been
        refused most of the time lately, and it is not a tenant under its share whose slots others have borrowed
        (for it, a retry takes back what was lent)."""
        return self.saturation(tenant).saturated and not self.by.lent(tenant, now_ns)

    def _saturated(self, wait_ns: int, finish_ns: int, why: RefusalCause) -> Reject:
        """A refusal that invites no retry here: on a saturated replica a retry would only take another call's
        place (`Saturation` in history.py). The hint still says when room frees, for a client with other replicas
        (`elsewhere`: whether there are any)."""
        self.events["saturated"] += 1
        ms, elsewhere = _ms(wait_ns), self.elsewhere
        return Reject(ms, finish_ns, within_budget=False, reason=why, saturated=True, elsewhere=elsewhere)

    def _frees_ms(self, finishes: dict[str, int], now_ns: int) -> int:
        """When the first slot frees, as slots really free (later than predicted): a hint for a fresh call."""
        stretch = self.by.lateness.stretch
        return _ms(min((stretch(now_ns, f) for f in finishes.values() if f > now_ns), default=now_ns) - now_ns)

    def _grace_ns(self, wait_ns: int) -> int:
        """How long past its hinted time a refused call's reservation or turn waits for its retry."""
        return max(self.reservation_grace_ns, wait_ns // 10)

    def _expire(self, now_ns: int) -> None:
        for key in [k for k, c in self.commitments.items() if c.is_reservation and c.expires_ns <= now_ns]:
            lapsed = self.commitments.pop(key)
            self.follow.observe(lapsed.tenant, lapsed.again, came=False)
            self.events["lapsed"] += 1
            self.lapsed[key] = None
            if len(self.lapsed) > 4 * self.max_reservations:  # the oldest first: a late retry comes soon or never
                del self.lapsed[next(iter(self.lapsed))]
        for key in [k for k, expires_ns in self.turns.items() if expires_ns <= now_ns]:
            del self.turns[key]
            self.events["turn_lapsed"] += 1


def _ms(ns: int) -> int:
    return max(math.ceil(ns / NS_PER_MS), 1)
