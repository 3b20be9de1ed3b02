"""Class priority under overload: an interactive call is admitted before a batch call that came earlier, and no
admitted call misses its deadline for it. Deterministic controller-level cases on a flat cost model, then the
virtual replica of steady_device.py (no torch, no clock: the same calls every run)."""

from __future__ import annotations

import pytest

from services.inference.admission import AdmissionConfig, AdmissionController, Admit, Commitment, RefusalCause, Reject
from services.inference.cost.model import CostModel
from tests.inference.steady_device import run
from tests.inference.test_admission import REFUSING
from tests.inference.test_retry_invitations import CAPACITY_PER_S, replica

MS = 1_000_000
S = 1_000 * MS
INTERACTIVE, BATCH = 50, 0


def flat(num_slots: int, per_class: int = 1, per_tenant: int = 1, us_per_row: float = 0.0) -> AdmissionController:
    """Every step 10 ms (plus `us_per_row` a row past the first); no margin, no spread: predictions are exact."""
    cost = CostModel([1, 256], [10_000.0, 10_000.0 + 255 * us_per_row], 0.0, num_deviations=0, deviation=0)
    c = AdmissionController(cost, AdmissionConfig(num_slots, 256, margin_ms=0, margin_fraction=0), REFUSING)
    c.priorities.per_class, c.shares.per_tenant = per_class, per_tenant
    return c


def call(rid: str, now_ns: int, priority: int, budget_ms: int = 10_000, tenant: str = "t") -> Commitment:
    """A call of 100 tokens: 1 s alone."""
    return Commitment(rid, 4, 100, now_ns + budget_ms * MS, tenant=tenant, priority=priority)


def test_an_interactive_call_is_admitted_before_a_batch_call_that_came_earlier():
    c = flat(num_slots=4)
    admitted: dict[str, tuple[Commitment, Admit]] = {}

    def decide(new: Commitment, now_ns: int):
        d = c.decide(new, now_ns)
        if isinstance(d, Admit):
            admitted[new.key] = (new, d)
        return d

    decide(call("i0", 0, INTERACTIVE, budget_ms=2_000), 0)  # the interactive class is active
    batch = [decide(call(f"b{i}", 1 * MS, BATCH), 1 * MS) for i in range(3)]
    # the batch calls take what is free but the slot kept for the interactive class
    assert [type(d).__name__ for d in batch] == ["Admit", "Admit", "Reject"]
    refused = batch[2]
    assert isinstance(refused, Reject) and refused.reason == RefusalCause.PRIORITY and not refused.reserved
    assert refused.retry_after_ms > 0 and refused.within_budget  # a retry hint, inside its 10 s budget
    # the interactive call that comes after it is admitted, at once
    late = decide(call("i1", 2 * MS, INTERACTIVE, budget_ms=2_000), 2 * MS)
    assert isinstance(late, Admit)
    # no admitted call is predicted past its deadline, on a cost model that predicts exactly
    assert all(d.predicted_finish_ns <= new.deadline_ns for new, d in admitted.values())
    assert all(finish <= c.commitments[rid].deadline_ns for rid, finish in _finishes(c).items())


def test_a_batch_call_is_kept_out_of_the_time_a_higher_class_needs():
    """Slots free, but an interactive call's budget has room for only so many beside it: the batch call that
    would take that room is refused for priority, and the interactive call after it meets its deadline."""
    c = flat(num_slots=32, per_class=1, us_per_row=1_000.0)  # 100 steps of 15 ms: 6 rows at most in 1.5 s
    c.decide(call("i0", 0, INTERACTIVE, budget_ms=1_500), 0)
    n = 0
    while isinstance(d := c.decide(call(f"b{n}", 0, BATCH, budget_ms=60_000), 0), Admit):
        n += 1
    assert d.reason == RefusalCause.PRIORITY and 0 < n < 10  # refused with slots still free
    assert isinstance(c.decide(call("i1", 0, INTERACTIVE, budget_ms=1_500), 0), Admit)
    assert all(finish <= c.commitments[rid].deadline_ns for rid, finish in _finishes(c).items())


def test_a_lower_class_reservation_does_not_block_a_higher_class_newcomer():
    c = flat(num_slots=2)
    for i in range(2):  # the batch fills the replica; no interactive call has come yet
        assert isinstance(c.decide(call(f"b{i}", 0, BATCH), 0), Admit)
    refused = c.decide(call("b2", 0, BATCH), 0)
    assert isinstance(refused, Reject) and refused.reserved  # a slot is reserved for its retry
    at_ns = refused.retry_after_ms * MS
    c.release("b0")
    # at the reserved time, before the batch retry, an interactive call takes the slot; a batch newcomer may not
    assert isinstance(c.decide(call("b3", at_ns, BATCH), at_ns), Reject)
    assert isinstance(c.decide(call("i0", at_ns, INTERACTIVE), at_ns), Admit)


def test_an_over_share_tenant_takes_no_reservation_of_a_tenant_under_its_share_whatever_its_class():
    c = flat(num_slots=4)

    def of(tenant: str, rid: str, now_ns: int, priority: int = BATCH) -> Commitment:
        return Commitment(f"{tenant}/{rid}", 4, 500, now_ns + 20 * S, tenant=tenant, priority=priority)

    assert isinstance(c.decide(of("modest", "m0", 0), 0), Admit)
    assert all(isinstance(c.decide(of("flood", f"f{i}", 0), 0), Admit) for i in range(2))
    assert isinstance(c.decide(of("modest", "m1", 0), 0), Admit)
    refused = c.decide(of("modest", "m2", 0), 0)
    assert isinstance(refused, Reject) and refused.reserved
    at_ns = refused.retry_after_ms * MS
    c.release("modest/m0")  # the modest tenant is under its share again, the flood at its own
    flood = c.decide(of("flood", "f2", at_ns, priority=INTERACTIVE), at_ns)
    assert isinstance(flood, Reject) and flood.reason == "over_share"
    assert isinstance(c.decide(of("modest", "m2", at_ns), at_ns), Admit)  # its retry finds its slot


def test_first_come_mode_has_no_priority():
    c = flat(num_slots=4)
    c.fair = False
    c.decide(call("i0", 0, INTERACTIVE), 0)
    assert all(isinstance(c.decide(call(f"b{i}", 0, BATCH), 0), Admit) for i in range(3))


STREAMS = {"interactive": ("t", INTERACTIVE, 2_000), "batch": ("t", BATCH, 4_000)}


@pytest.mark.parametrize("seed", [1, 2])
def test_under_overload_the_interactive_class_is_served_first_and_no_admitted_call_misses(seed):
    rates = {"interactive": 0.5 * CAPACITY_PER_S, "batch": 3 * CAPACITY_PER_S}
    tallies = {}
    for fair in (False, True):
        controller = replica()
        controller.fair = fair
        tallies[fair] = run(controller, rates, 30.0, seed=seed, max_attempts=8, streams=STREAMS)
    first_come, by_class = tallies[False], tallies[True]

    def attainment(tally, stream: str) -> float:
        return tally.by_tenant[stream]["in_deadline"] / tally.by_tenant[stream]["calls"]

    assert attainment(by_class, "interactive") >= 0.85
    assert attainment(by_class, "interactive") >= attainment(first_come, "interactive") + 0.4
    assert attainment(by_class, "interactive") > 2 * attainment(by_class, "batch")
    assert by_class.by_tenant["batch"]["refused_priority"] > 0
    assert len(by_class.misses) <= 0.005 * by_class.num_admitted
    # the replica stays used: the batch class takes what the interactive one leaves
    assert by_class.goodput(30.0) >= 0.95 * first_come.goodput(30.0)


def _finishes(c: AdmissionController) -> dict[str, int]:
    running = [x for x in c.commitments.values() if not x.is_reservation]
    return c.predictor.finish_times(running, 3 * MS)


def test_classes_sending_a_trickle_keep_little_and_attainment_follows_priority():
    """Three classes at 0.1x capacity each above a batch flood: each keeps as many slots as it offers (not
    per_class), so the replica stays used, and the higher a class, the more of its calls finish in deadline."""
    streams = {"p90": ("t", 90, 2_000), "p60": ("t", 60, 2_000), "p30": ("t", 30, 3_000), "p0": ("t", 0, 4_000)}
    rates = {name: 0.1 * CAPACITY_PER_S for name in ("p90", "p60", "p30")} | {"p0": 3 * CAPACITY_PER_S}
    tallies = {}
    for fair in (False, True):
        controller = replica()
        controller.fair = fair
        tallies[fair] = run(controller, rates, 30.0, seed=1, max_attempts=8, streams=streams)
    by_class = tallies[True]
    attained = [by_class.by_tenant[s]["in_deadline"] / by_class.by_tenant[s]["calls"] for s in streams]
    assert attained == sorted(attained, reverse=True) and attained[0] >= 0.95
    assert not by_class.misses
    assert by_class.goodput(30.0) >= 0.95 * tallies[False].goodput(30.0)


def test_a_call_no_replica_could_serve_in_time_keeps_no_headroom_for_its_class():
    """An interactive call refused as infeasible (its budget is too short even alone) is no reason to refuse the
    standard calls after it: the replica is idle."""
    c = flat(num_slots=8)
    assert not isinstance(c.decide(call("i0", 0, INTERACTIVE, budget_ms=50), 0), (Admit, Reject))
    after = [c.decide(call(f"s{i}", MS, BATCH), MS) for i in range(8)]
    assert all(isinstance(d, Admit) for d in after)


@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_a_replica_of_few_slots_keeps_none_for_a_class_that_sent_one_call(num_slots: int):
    """Classes keep at most a quarter of the slots: on a replica of fewer than four, one interactive call does not
    hold the others' slots for the seconds its class stays active."""
    c = flat(num_slots=num_slots, per_class=4)
    assert isinstance(c.decide(call("i0", 0, INTERACTIVE, budget_ms=2_000), 0), Admit)
    c.release("i0")
    after = [c.decide(call(f"s{i}", MS, BATCH), MS) for i in range(num_slots)]
    assert all(isinstance(d, Admit) for d in after)
