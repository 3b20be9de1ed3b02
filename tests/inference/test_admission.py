"""Admission decisions and the cost model on their own, with a known step-time curve (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.inference.admission import (
    DEFAULT_SETTINGS,
    AdmissionConfig,
    AdmissionController,
    AdmissionSettings,
    Admit,
    Commitment,
    Infeasible,
    Predictor,
    Reject,
)
from services.inference.admission.checks import Calendar
from services.inference.admission.fifo import FifoAdmission
from services.inference.cost.model import CostModel, fit_context_cost

MS = 1_000_000
# the refusal's own contract (its hint, its reservation, its held turn): a call that could be held in its slack, or
# whose prompt waits for the step budget, or whose KV blocks free later, is refused here, as with `zeroqueue serve
# --no-hold --no-hold-prompts --no-hold-blocks`; test_hold.py judges the hold, test_burst_prompts.py the prompts
# admitted behind a burst's, test_admission_blocks.py the calls held for their blocks
REFUSING = AdmissionSettings(hold_in_slack=False, hold_for_prompts=False, hold_for_blocks=False)


def flat_cost(step_ms=10.0):
    """Every step takes step_ms whatever the batch; no context cost; no inflation."""
    return CostModel(
        rows=[1, 256],
        row_us=[step_ms * 1000, step_ms * 1000],
        us_per_context_token=0.0,
        num_deviations=0.0,
        deviation=0.0,
    )


def controller(slots=4, step_ms=10.0, margin_ms=0.0, settings=REFUSING):
    return AdmissionController(
        flat_cost(step_ms), AdmissionConfig(slots, 256, margin_ms=margin_ms, margin_fraction=0.0), settings
    )


def commit(rid, prompt=4, max_tokens=10, deadline_ms=1000, now_ms=0):
    return Commitment(rid, prompt, max_tokens, (now_ms + deadline_ms) * MS)


def test_admission_modules_do_not_import_torch():
    code = "import sys, services.inference.admission; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_cost_model_interpolates_and_extrapolates():
    cost = CostModel(
        rows=[1, 8, 32], row_us=[1000, 1700, 4100], us_per_context_token=2.0, num_deviations=0, deviation=0
    )
    assert cost.raw_step_us(8) == 1700
    assert cost.raw_step_us(20) == pytest.approx(1700 + 12 * 100)
    assert cost.raw_step_us(64) == pytest.approx(4100 + 32 * 100)
    assert cost.raw_step_us(8, context_tokens=50) == 1800
    assert fit_context_cost(10, 1000.0, 110, 1500.0) == 5.0


def test_cost_model_learns_a_slower_device_online():
    cost = CostModel(rows=[1, 2], row_us=[1000, 1100], us_per_context_token=0.0)
    before = cost.step_us(1)
    for _ in range(200):
        cost.observe(1, 0, 2000)
    assert cost.ratio == pytest.approx(2.0, rel=0.01)
    assert before == pytest.approx(1150)  # 1000 µs × (ratio 1 + 3 deviations of 0.05)
    assert cost.step_us(1) == pytest.approx(2000, rel=0.01)


def test_the_watchdog_moves_predictions_both_ways_at_once():
    cost = CostModel(rows=[1, 2], row_us=[1000, 1100], us_per_context_token=0.0)
    cost.follow(4.0)  # said slow: 4x at once
    for _ in range(20):
        cost.observe(1, 0, 4000)
    assert cost.ratio == pytest.approx(4.0)
    cost.observe(1, 0, 1000)  # recovered: one step alone moves the running ratio 5 % of the way
    assert cost.ratio > 3.8
    cost.settle(1.05)  # said healthy, at 1.05x calibrated
    assert cost.ratio == 1.05
    cost.settle(2.0)  # a recovery never raises the prediction
    assert cost.ratio == 1.05


def test_one_stalled_step_cannot_lock_admission_out_but_a_slow_run_still_counts():
    cost = CostModel(rows=[1, 2], row_us=[1000, 1100], us_per_context_token=0.0)
    for _ in range(50):
        cost.observe(1, 0, 1000)
    cost.observe(1, 0, 1_100_000)  # a 1.1-s stall of a 1-ms step (seen in a soak under load)
    assert cost.step_us(1) < 1000 * 2  # was 66 x its ratio: every call refused as infeasible
    for _ in range(200):
        cost.observe(1, 0, 6000)  # a device that really runs 6x slower, step after step
    assert cost.ratio == pytest.approx(6.0, rel=0.01)  # learnt all the same


def test_noisy_steps_widen_the_prediction():
    steady, noisy = (CostModel(rows=[1, 2], row_us=[1000, 1000], us_per_context_token=0.0) for _ in range(2))
    for i in range(300):
        steady.observe(1, 0, 1000)
        noisy.observe(1, 0, 600 if i % 2 else 1400)
    assert noisy.step_us(1) > steady.step_us(1) * 1.3


def test_finish_times_follow_the_shrinking_batch():
    cost = CostModel(
        rows=[1, 2, 3], row_us=[10_000, 20_000, 30_000], us_per_context_token=0.0, num_deviations=0, deviation=0
    )
    predictor = Predictor(cost, AdmissionConfig(4, 256))
    commitments = [Commitment("a", 1, 2, 10**12, num_generated=1), Commitment("b", 1, 5, 10**12, num_generated=1)]
    finish = predictor.finish_times(commitments, 0)
    # a needs 1 step at batch 2 (20 ms); b then needs 3 more steps at batch 1 (30 ms)
    assert finish == {"a": 20 * MS, "b": 50 * MS}


def test_admit_when_the_deadline_is_met():
    c = controller()
    decision = c.decide(commit("a", max_tokens=10, deadline_ms=200), 0)
    assert isinstance(decision, Admit) and decision.predicted_finish_ns == 100 * MS
    assert c.num_admitted == 1


def test_infeasible_even_when_idle_reports_the_minimum_budget():
    c = controller(margin_ms=5)
    decision = c.decide(commit("a", max_tokens=10, deadline_ms=50), 0)
    assert decision == Infeasible(min_budget_ms=105)
    assert isinstance(c.decide(commit("b", max_tokens=10, deadline_ms=105), 0), Admit)


def test_full_slots_reject_with_the_time_the_first_slot_frees():
    c = controller(slots=2)
    assert isinstance(c.decide(commit("a", max_tokens=5), 0), Admit)
    assert isinstance(c.decide(commit("b", max_tokens=20), 0), Admit)
    decision = c.decide(commit("c", max_tokens=5, deadline_ms=1000), 0)
    assert isinstance(decision, Reject) and decision.retry_after_ms == 50


def test_newcomer_may_not_push_an_admitted_request_past_its_deadline():
    slow = CostModel(rows=[1, 2], row_us=[10_000, 30_000], us_per_context_token=0.0, num_deviations=0, deviation=0)
    c = AdmissionController(slow, AdmissionConfig(4, 256, margin_ms=0, margin_fraction=0), REFUSING)
    # a one-token prompt is its own row of its first step: 10 steps of 10 ms
    assert c.decide(commit("tight", prompt=1, max_tokens=10, deadline_ms=150), 0) == Admit(100 * MS)
    # the newcomer's own deadline is generous, but at batch 2 "tight" would take 340 ms
    decision = c.decide(commit("late", prompt=1, max_tokens=10, deadline_ms=10_000), 0)
    assert isinstance(decision, Reject)
    # "tight" began a step when it was admitted: a 1-row step of 10 ms that brings its first token, so its slot
    # frees after that step and 9 more, at 100 ms (the newcomer would only join after the step in flight)
    assert decision.retry_after_ms == 100


def test_a_rejected_call_reserves_capacity_for_its_retry():
    c = controller(slots=2)
    c.decide(commit("a", max_tokens=5), 0)
    c.decide(commit("b", max_tokens=50), 0)
    reject = c.decide(commit("retry", max_tokens=5, deadline_ms=1000), 0)
    assert isinstance(reject, Reject)
    c.release("a")  # a finished at 50 ms
    stranger = c.decide(commit("stranger", max_tokens=5, deadline_ms=1000, now_ms=50), 50 * MS)
    assert isinstance(stranger, Reject), "the freed slot is held for the hinted retry"
    assert isinstance(c.decide(commit("retry", max_tokens=5, deadline_ms=1000), 50 * MS), Admit)


def test_reservation_expires_when_the_retry_never_comes():
    c = AdmissionController(
        flat_cost(),
        AdmissionConfig(1, 256, margin_ms=0, margin_fraction=0),
        AdmissionSettings(reservation_grace_ms=20, hold_in_slack=False),
    )
    c.decide(commit("a", max_tokens=5), 0)
    assert isinstance(c.decide(commit("ghost", max_tokens=5), 0), Reject)
    c.release("a")
    assert isinstance(c.decide(commit("late", max_tokens=5, now_ms=100), 100 * MS), Admit)


def test_fifo_admits_everything():
    f = FifoAdmission()
    for i in range(100):
        assert isinstance(f.decide(commit(str(i), deadline_ms=1), 0), Admit)
    assert f.num_admitted == 100


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(50, 2000)), min_size=1, max_size=12), st.integers(1, 6))
def test_admitted_set_is_always_predicted_to_meet_every_deadline(arrivals, slots):
    c = controller(slots=slots)
    for i, (max_tokens, deadline_ms) in enumerate(arrivals):
        decision = c.decide(commit(f"r{i}", max_tokens=max_tokens, deadline_ms=deadline_ms), 0)
        admitted = [x for x in c.commitments.values() if x.reserved_from_ns is None]
        assert len(admitted) <= slots
        finish = c.predictor.finish_times(admitted, 0)
        assert all(finish[x.key] <= x.deadline_ns for x in admitted)
        if isinstance(decision, Reject):
            assert decision.retry_after_ms >= 1


def test_two_rejected_calls_do_not_share_one_freed_slot():
    c = controller(slots=2, step_ms=1.0)
    assert isinstance(c.decide(commit("r1", max_tokens=100), 0), Admit)
    assert isinstance(c.decide(commit("r2", max_tokens=300), 0), Admit)
    a = c.decide(commit("a", max_tokens=10), 0)
    b = c.decide(commit("b", max_tokens=10), 0)
    assert isinstance(a, Reject) and isinstance(b, Reject)
    assert a.retry_after_ms == 100, "a slot frees when r1 finishes"
    assert b.retry_after_ms == 110, "b's slot is the one a's retry frees, not r1's again"
    c.release("r1")
    assert isinstance(c.decide(commit("a", max_tokens=10), 100 * MS), Admit)
    c.on_progress("a", 10)
    c.release("a")
    assert isinstance(c.decide(commit("b", max_tokens=10), 110 * MS), Admit)


def test_no_slot_inside_the_budget_says_so_and_reserves_nothing():
    c = controller(slots=1, step_ms=1.0)
    c.decide(commit("long", max_tokens=500, deadline_ms=10_000), 0)
    decision = c.decide(commit("short", max_tokens=10, deadline_ms=100), 0)
    assert isinstance(decision, Reject) and not decision.within_budget
    assert decision.retry_after_ms == 500 and c.num_reserved == 0


def test_peak_occupancy_of_half_open_intervals():
    from services.inference.admission import peak_occupancy

    assert peak_occupancy([(0, 10), (10, 20)], 0, 20) == 1
    assert peak_occupancy([(0, 10), (5, 20), (8, 9)], 0, 20) == 3
    assert peak_occupancy([(0, 10)], 10, 20) == 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(20, 3000), st.integers(0, 50)), min_size=1, max_size=20),
    st.integers(1, 4),
)
def test_the_slot_calendar_is_never_overbooked(arrivals, slots):
    from services.inference.admission import peak_occupancy, progressed

    c = controller(slots=slots, step_ms=1.0)
    now, last = 0, 0
    for i, (max_tokens, budget_ms, gap_ms) in enumerate(arrivals):
        now += gap_ms * MS
        running = [x for x in c.commitments.values() if not x.is_reservation]  # the device runs as predicted
        moved = {x.key: x for x in progressed(running, c.predictor.finish_times(running, last), last, now)}
        for x in running:
            if x.key in moved:
                c.on_progress(x.key, moved[x.key].num_generated)
            else:
                c.release(x.key)
        last = now
        c.decide(Commitment(f"r{i}", 4, max_tokens, now + budget_ms * MS), now)
        admitted = [x for x in c.commitments.values() if not x.is_reservation]
        finishes = c.predictor.finish_times(admitted, now)
        intervals = [(now, finishes[x.key]) for x in admitted]
        intervals += [(x.reserved_from_ns, x.reserved_until_ns) for x in c.commitments.values() if x.is_reservation]
        assert peak_occupancy(intervals, now, now + 10**13) <= slots


class EveryCheckPredicts(Calendar):
    def full_at(self, at_ns, num_running, reservations):
        return False

    def fits_at(self, new, scene, ahead_of_later_reservations=False, finish_unused=False):
        return super().fits_at(new, scene, ahead_of_later_reservations)


class NoShortcut(AdmissionController):
    """The controller without its quick answers ('no slot free at that instant', 'the calendar is full before
    the shortest run could end'): every check predicts."""

    def __init__(self, cost, config, settings=DEFAULT_SETTINGS):
        super().__init__(cost, config, settings)
        self.calendar = EveryCheckPredicts(
            self.predictor, self.lateness, config.num_slots, self.settings.max_retry_candidates
        )


# calibrations that rise with the rows, and one whose noise dips (a floor must hold for it too)
CALIBRATIONS = [([1, 8, 32], [2000, 4000, 15000]), ([1, 8, 32, 64], [2000, 4000, 3000, 15000]), ([4, 16], [3000, 2500])]


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 12),
    st.sampled_from(CALIBRATIONS),
    st.sampled_from([0, 16, 64]),
    st.lists(
        st.tuples(
            st.sampled_from(["decide", "progress", "release", "late"]),
            st.integers(0, 30),
            st.integers(1, 64),
            st.integers(20, 3000),
            st.integers(1, 100),
        ),
        min_size=1,
        max_size=60,
    ),
)
def test_the_quick_answers_never_change_a_decision(slots, calibration, pace, ops):
    cost = CostModel(rows=calibration[0], row_us=calibration[1], us_per_context_token=0.5)
    quick = AdmissionController(cost, AdmissionConfig(slots, 256, pace_tokens=pace))
    slow = NoShortcut(cost, AdmissionConfig(slots, 256, pace_tokens=pace))
    now, ids = 0, []
    for i, (op, gap_ms, tokens, deadline_ms, pick) in enumerate(ops):
        now += gap_ms * MS
        if op == "decide":
            rid = ids[pick % len(ids)] if ids and pick % 4 == 0 else f"r{i}"  # some retries of old ids
            a, b = (c.decide(Commitment(rid, pick, tokens, now + deadline_ms * MS), now) for c in (quick, slow))
            # the reply's predicted finish may differ; the decision and the hint may not
            assert type(a) is type(b) and {**a.__dict__, "predicted_finish_ns": 0} == {
                **b.__dict__,
                "predicted_finish_ns": 0,
            }
            ids.append(rid)
        elif op == "progress" and ids:
            for c in (quick, slow):
                c.on_progress(ids[pick % len(ids)], tokens)
        elif op == "release" and ids:
            for c in (quick, slow):
                c.release(ids[pick % len(ids)])
        elif op == "late":
            for c in (quick, slow):
                c.observe_finish(pick * MS, pick * MS * (100 + tokens) // 100)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(CALIBRATIONS),
    st.sampled_from([0, 16, 64]),
    st.integers(1, 8),
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 64), st.integers(0, 64)), max_size=16),
    st.tuples(st.integers(1, 300), st.integers(1, 64), st.integers(0, 64)),
)
def test_the_earliest_finish_is_a_floor_under_every_prediction(calibration, pace, slots, others, new):
    cost = CostModel(rows=calibration[0], row_us=calibration[1], us_per_context_token=0.5, ratio=1.3, deviation=0.2)
    predictor = Predictor(cost, AdmissionConfig(slots, 128, pace_tokens=pace), max_batch=len(others) + 1)
    made = [
        Commitment(f"o{i}", prompt, max_tokens, 10**12, num_generated=min(done, max_tokens))
        for i, (prompt, max_tokens, done) in enumerate(others)
    ]
    mine = Commitment("new", new[0], new[1], 10**12, num_generated=min(new[2], new[1]))
    floor = predictor.earliest_finish(mine, 5 * MS)
    assert floor <= predictor.finish_times([*made, mine], 5 * MS)["new"]
    if calibration == CALIBRATIONS[0] and mine.num_prefill_tokens <= pace:  # rising steps, no prompt cost:
        assert floor == predictor.finish_times([mine], 5 * MS)["new"]  # the floor is the run alone


def test_a_run_of_k_steps_spreads_by_root_k_step_deviations():
    cost = CostModel(rows=[1, 2], row_us=[1000, 1000], us_per_context_token=0.0, deviation=0.1, num_deviations=3)
    predictor = Predictor(cost, AdmissionConfig(4, 256))
    (finish,) = predictor.finish_times([Commitment("a", 1, 100, 10**12, num_generated=1)], 0).values()
    # 99 steps of 1 ms expected, spread 0.1 ms each: 99 ms + 3 × √99 × 0.1 ms, not 99 × 1.3 ms
    assert finish == pytest.approx((99_000 + 3 * 99**0.5 * 100) * 1000, abs=1)


def test_infeasible_is_judged_on_the_idle_calibration_not_on_a_slowed_replica():
    """A budget an idle replica meets is never called infeasible because this one runs slow or loaded: it is
    refused (retry elsewhere), and the minimum budget it is told comes from the calibration."""
    c = controller(margin_ms=5)
    c.predictor.cost.follow(4.0)  # the device runs 4x slower than calibrated
    slowed = c.decide(commit("a", max_tokens=10, deadline_ms=200), 0)  # idle: 100 ms; here: 400 ms
    assert isinstance(slowed, Reject) and not slowed.within_budget
    assert c.decide(commit("b", max_tokens=10, deadline_ms=50), 0) == Infeasible(min_budget_ms=105)
