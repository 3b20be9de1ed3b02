"""The checks of one admission decision, in the order controller.py `_decide` runs them. No torch.

1. feasible at all (`infeasible`): an idle replica would finish the call inside its budget; else INFEASIBLE.
2. headroom kept for others (`kept_for_others`): the free slot it would take is not one kept in hand for other
   tenants (OVER_SHARE) or a higher class (PRIORITY); headroom.py says how much is kept.
3. fits now beside the running calls (`Calendar.fits_at`): a slot free for its whole run (SLOTS_FULL), its own
   deadline met (DEADLINE), no admitted call pushed past one it was predicted to meet (DELAYS_ADMITTED), and where
   admission plans the KV pool, its blocks free for its whole run (KV_BLOCKS).
Then refusals.py admits it, or holds its turn for the step budget (STEP_BUDGET), or refuses it with the earliest
time a retry would pass check 3 (`Calendar.earliest_retry`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from .decisions import NS_PER_MS, Commitment, Infeasible, RefusalCause
from .headroom import Headroom
from .history import Lateness
from .predictor import Predictor, from_their_time, peak_occupancy, progressed


@dataclass(slots=True)  # not frozen: a frozen dataclass costs ~1 µs more to make, and a refusal makes ~10
class Arrival:
    """The call being decided and what it holds: a retry on time for its reservation, or one whose turn in the
    step budget was held for it (on_time implies has_turn)."""

    new: Commitment
    now_ns: int
    on_time: bool = False
    has_turn: bool = False


@dataclass(slots=True)  # not frozen: a frozen dataclass costs ~1 µs more to make, and a refusal makes ~10
class Scene:
    """What a call is judged beside at `at_ns`: the calls running then, their predicted finishes from then, and
    the reservations that hold their slots against it. `before`: the finishes the running calls were predicted
    to meet before it (None: `finishes`; 0 for a phantom of headroom, which is always kept). `free_blocks`: the KV
    pool's blocks free at `at_ns` besides those the running calls hold until their ends (None: the pool is not
    planned, as where it holds every slot's longest call)."""

    at_ns: int
    admitted: list[Commitment]
    finishes: dict[str, int]
    reservations: list[Commitment]
    before: dict[str, int] | None = None
    free_blocks: int | None = None


def fewest_free_blocks(
    free_blocks: int, releases: list[tuple[int, int]], reservations: list[Commitment], start_ns: int, end_ns: int
) -> int:
    """The fewest KV blocks free at any instant of [start_ns, end_ns): `free_blocks` free at start_ns, plus what
    each running call gives back at its end (`releases`: (end, blocks), as slots really free), less what each
    reservation takes over its window (a held call's too: where blocks are planned it takes them at its start).
    At a tie a call gives back before a reservation takes, as slots are counted (`peak_occupancy`)."""
    events = list(releases)
    for r in reservations:
        if r.num_blocks:
            events += [(r.reserved_from_ns, -r.num_blocks), (r.reserved_until_ns, r.num_blocks)]
    free = fewest = free_blocks + sum(delta for at_ns, delta in events if at_ns <= start_ns)
    during = sorted((e for e in events if start_ns < e[0] < end_ns), key=lambda e: (e[0], -e[1]))
    for _, delta in during:
        free += delta
        fewest = min(fewest, free)
    return fewest


def ahead_of_later(reservations: list[Commitment], at_ns: int) -> list[Commitment]:
    """The reservations a retry on time for its own, at `at_ns`, does not go ahead of: those due by then, and held
    calls (they were admitted)."""
    return [r for r in reservations if r.held or r.reserved_from_ns <= at_ns]


def limit(predictor: Predictor, c: Commitment, at_ns: int) -> int:
    """The latest predicted finish `c` is admitted with: its deadline less the safety margin."""
    return c.deadline_ns - predictor.margin_for(c, at_ns)


def infeasible(idle: Predictor, new: Commitment, now_ns: int) -> Infeasible | None:
    """Check 1: no idle replica could meet `new`'s budget. Judged on the calibration as it was measured on the
    idle device, never on the running ratio, which a loaded or slowed replica inflates."""
    idle_finish_ns = idle.finish_times([new], now_ns)[new.key]
    if idle_finish_ns <= limit(idle, new, now_ns):
        return None
    return Infeasible(min_budget_ms=math.ceil(idle.config.min_budget_ns(idle_finish_ns - now_ns) / NS_PER_MS))


def kept_for_others(room: Headroom, num_slots: int, now: Scene) -> RefusalCause | None:
    """Check 2: whether the free slot `new` would take is one kept in hand for others: for tenants that are modest
    or under their share (OVER_SHARE), else for a higher class (PRIORITY); None if it is not."""
    held = sum(1 for r in now.reservations if r.reserved_from_ns <= now.at_ns < r.reserved_until_ns)
    free_after = num_slots - len(now.admitted) - held - 1
    if room.for_tenants and free_after < room.for_tenants:
        return RefusalCause.OVER_SHARE
    return RefusalCause.PRIORITY if 0 <= free_after < room.num_slots else None  # none free: slots full, as for anyone


class Calendar:
    """Check 3, and the search for a retry that passes it. Slots over time form a calendar: a running call holds
    one until its predicted finish (stretched as calls really finish, `Lateness`), a reservation over its
    reserved interval; and every deadline must hold. Where admission plans the KV pool, blocks are counted on the
    same calendar: a running call holds its blocks as it holds its slot, a reservation takes its blocks over its
    window, so a refused call's retry finds both."""

    def __init__(self, predictor: Predictor, lateness: Lateness, num_slots: int, max_retry_candidates: int) -> None:
        self.predictor = predictor
        self.lateness = lateness
        self.num_slots = num_slots
        self.max_retry_candidates = max_retry_candidates

    def with_headroom(self, now: Scene, room: Headroom) -> Scene:
        """`now` with the headroom in time added: its phantoms must still meet their deadlines, always."""
        if not room.phantoms:
            return now
        admitted = now.admitted + list(room.phantoms)
        before = {**{p.key: 0 for p in room.phantoms}, **now.finishes}
        finishes = self.predictor.finish_times(admitted, now.at_ns)
        return Scene(now.at_ns, admitted, finishes, now.reservations, before, now.free_blocks)

    def fits_at(
        self, new: Commitment, scene: Scene, ahead_of_later_reservations: bool = False, finish_unused: bool = False
    ) -> tuple[RefusalCause | None, int]:
        """None if `new` joining at `scene.at_ns` meets every deadline and finds a free slot (and, where the pool is
        planned, its KV blocks) for its whole run, else why not (SLOTS_FULL, DEADLINE, DELAYS_ADMITTED, KV_BLOCKS);
        and `new`'s predicted finish from then.
        A retry that comes for its reservation goes ahead of reservations due after it: they were planned
        behind it, on predictions that have since moved, so they wait (or are refused) rather than it.
        With `finish_unused`, a no may come with 0 for the finish, before any prediction."""
        at_ns, admitted, finishes, reservations, before = (
            scene.at_ns, scene.admitted, scene.finishes, scene.reservations, scene.before
        )  # fmt: skip
        if ahead_of_later_reservations:  # never ahead of a held call: it was admitted
            reservations = ahead_of_later(reservations, at_ns)
        # slots free when calls really finish, which is later than predicted
        stretch = self.lateness.stretch
        intervals = [(at_ns, stretch(at_ns, finishes[c.key])) for c in admitted]
        intervals += [(r.reserved_from_ns, r.reserved_until_ns) for r in reservations]
        if finish_unused:  # the calendar is full before even the shortest run `new` could have ends: a quick no
            shortest_ns = stretch(at_ns, self.predictor.earliest_finish(new, at_ns))
            if peak_occupancy(intervals, at_ns, shortest_ns) >= self.num_slots:
                return RefusalCause.SLOTS_FULL, 0
        if self.full_at(at_ns, sum(1 for f in finishes.values() if f > at_ns), reservations):
            if finish_unused:
                return RefusalCause.SLOTS_FULL, 0
            return RefusalCause.SLOTS_FULL, self.predictor.finish_times([*admitted, new], at_ns)[new.key]
        ok, finish_ns = self.predictor.meets_deadlines(admitted, new, at_ns, finishes if before is None else before)
        due = [r for r in reservations if r.reserved_from_ns < finish_ns and r.reserved_until_ns > at_ns]
        if ok and due:  # retries arriving during the run share its steps: count them as running too
            due = from_their_time(self.predictor, due, at_ns, len(admitted) + len(due) + 1)
            with_due = self.predictor.finish_times(admitted + due, at_ns)
            ok, finish_ns = self.predictor.meets_deadlines(
                admitted + due, new, at_ns, with_due if before is None else {**with_due, **before}
            )
        holds_until = stretch(at_ns, finish_ns)
        # slots before deadlines, as the quick answers above (finish_unused: no reason wanted, no count after a no)
        if (ok or not finish_unused) and peak_occupancy(intervals, at_ns, holds_until) >= self.num_slots:
            return RefusalCause.SLOTS_FULL, finish_ns
        if not ok:  # meets_deadlines said no, for its own deadline or for another's
            own = finish_ns > limit(self.predictor, new, at_ns)
            return (RefusalCause.DEADLINE if own else RefusalCause.DELAYS_ADMITTED), finish_ns
        if self.blocks_short(new, scene, holds_until, reservations):
            return RefusalCause.KV_BLOCKS, finish_ns
        return None, finish_ns

    def blocks_short(
        self, new: Commitment, scene: Scene, end_ns: int, reservations: list[Commitment] | None = None
    ) -> bool:
        """Where the KV pool is planned: whether `new`'s blocks, taken at `scene.at_ns` and held until `end_ns`, are
        not free all that time beside the running calls' and the reservations' (`reservations`: those that hold
        theirs against it, if not the scene's)."""
        if scene.free_blocks is None or not new.num_blocks:
            return False
        at_ns, stretch = scene.at_ns, self.lateness.stretch
        releases = [(stretch(at_ns, scene.finishes[c.key]), c.num_blocks) for c in scene.admitted if c.num_blocks]
        held = scene.reservations if reservations is None else reservations
        return fewest_free_blocks(scene.free_blocks, releases, held, at_ns, end_ns) < new.num_blocks

    def full_at(self, at_ns: int, num_running: int, reservations: list[Commitment]) -> bool:
        """No slot free at the instant `at_ns`: a quick no, before the cost of any prediction (the calendar's
        peak over a run is at least its occupancy at the run's start)."""
        held = sum(1 for r in reservations if r.reserved_from_ns <= at_ns < r.reserved_until_ns)
        return num_running + held >= self.num_slots

    def fits_beside_tenants(self, new: Commitment, now: Scene, room: Headroom) -> bool:
        """`new` would fit now if it left room only for other tenants: the headroom of a higher class refused it.
        `now`: the running calls and their predicted finishes, without phantoms."""
        tenants = now.admitted + list(room.phantoms[: room.num_tenant_phantoms])
        before = {**{p.key: 0 for p in tenants[len(now.admitted) :]}, **now.finishes}
        finishes = self.predictor.finish_times(tenants, now.at_ns)
        scene = Scene(now.at_ns, tenants, finishes, now.reservations, before, now.free_blocks)
        return self.fits_at(new, scene)[0] is None

    def earliest_retry(self, new: Commitment, now: Scene, slack: float) -> tuple[int, int] | None:
        """The first moment a slot frees (a call finishes or a reservation ends) from which `new` would be
        admitted inside its own deadline with `slack` runs to spare, with its predicted finish from then; None
        if there is none."""
        now_ns, admitted, reservations = now.at_ns, now.admitted, now.reservations
        slot_ends = {key: self.lateness.stretch(now_ns, f) for key, f in now.finishes.items()}
        frees = {f for f in slot_ends.values() if f > now_ns} | {r.reserved_until_ns for r in reservations}
        # a running call still holds its slot at a candidate time iff it is predicted to end after it and has
        # tokens left (progressed leaves it short of max_tokens then): counted before copying anything
        holding = sorted(slot_ends[c.key] for c in admitted if c.num_generated < c.max_tokens)
        for at_ns in sorted(frees)[: self.max_retry_candidates]:
            if at_ns >= new.deadline_ns:
                break
            if self.full_at(at_ns, len(holding) - bisect.bisect_right(holding, at_ns), reservations):
                continue
            later = progressed(admitted, slot_ends, now_ns, at_ns)
            free_blocks = now.free_blocks  # and the blocks of the calls that have ended by then
            if free_blocks is not None:
                free_blocks += sum(c.num_blocks for c in admitted if slot_ends[c.key] <= at_ns)
            then = Scene(at_ns, later, self.predictor.finish_times(later, at_ns), reservations, free_blocks=free_blocks)
            why, finish_ns = self.fits_at(new, then, finish_unused=True)
            if why is None and finish_ns + slack * (finish_ns - at_ns) <= limit(self.predictor, new, at_ns):
                return at_ns, finish_ns
        return None
