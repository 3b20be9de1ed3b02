"""Admission sees the engine's steps as they run: a call decided while a step runs joins only the step after it,
and a prompt costs the chunks it runs in, not the marginal row of the batch where the step time bends up (a long
prompt on a CPU). Judged on hand-made step times and on the virtual replica of steady_device.py, which runs
exactly as calibrated. No torch, no clock."""

from __future__ import annotations

import pytest

from services.inference.admission import (
    AdmissionConfig,
    AdmissionController,
    Admit,
    Commitment,
    FifoAdmission,
    Infeasible,
    Reject,
)
from services.inference.admission.predictor import Predictor
from services.inference.cost.model import CostModel
from services.inference.engine.digest import StepDigest
from services.inference.metrics import ServiceMetrics, StepLog, StepStats
from services.inference.sched.scheduler import ScheduledSeq, SchedulerOutput
from tests.inference.steady_device import run
from tests.inference.test_admission import REFUSING

MS = 1_000_000


def linear_cost() -> CostModel:
    """A step of r rows takes 9 ms + 1 ms a row: a 256-row prompt chunk 265 ms, a lone decode 10 ms."""
    return CostModel([1, 256], [10_000.0, 265_000.0], 0.0, num_deviations=0, deviation=0)


def bending_up() -> CostModel:
    """A CPU's shape: the second row of a step costs 0.1 ms, a 256-row chunk 290 ms more than one row."""
    return CostModel([1, 2, 256], [10_000.0, 10_100.0, 300_000.0], 0.0, num_deviations=0, deviation=0)


def controller(cost: CostModel, slots: int = 4) -> AdmissionController:
    return AdmissionController(cost, AdmissionConfig(slots, 256, margin_ms=0, margin_fraction=0), REFUSING)


def test_a_call_decided_during_a_long_prompt_chunk_is_predicted_after_it():
    c = controller(linear_cost())
    assert isinstance(c.decide(Commitment("long", 200, 10, 10_000 * MS), 0), Admit)  # its 209-ms chunk begins
    short = c.decide(Commitment("short", 1, 1, 10_000 * MS), 5 * MS)
    assert isinstance(short, Admit)
    # it joins the step after the chunk (209 ms), a step of two rows (11 ms): not 5 ms + a step from now
    assert short.predicted_finish_ns == (209 + 11) * MS


def test_the_step_in_flight_is_the_one_the_engine_last_reported_beginning():
    c = controller(linear_cost())
    c.decide(Commitment("long", 200, 10, 10_000 * MS), 0)
    c.on_progress("long", 1)
    c.step_ended(209 * MS)  # the chunk ended with its first token; a decode step of 10 ms began
    short = c.decide(Commitment("short", 1, 1, 10_000 * MS), 214 * MS)
    assert isinstance(short, Admit) and short.predicted_finish_ns == (219 + 11) * MS
    # a step overdue adds nothing: nothing is known of when it ends, so the call is predicted as from now
    c.step_ended(240 * MS)
    later = Commitment("later", 1, 1, 10_000 * MS)
    admitted = list(c.commitments.values())
    decision = c.decide(later, 400 * MS)
    from_now = Predictor(c.predictor.cost, c.config).finish_times([*admitted, later], 400 * MS)
    assert isinstance(decision, Admit) and decision.predicted_finish_ns == from_now["later"]


def test_what_the_step_in_flight_brings_is_not_counted_twice():
    """A decoding call's token and a prompt's last chunk in the step in flight are that step's, not steps more."""
    c = controller(linear_cost())
    c.decide(Commitment("a", 1, 3, 10_000 * MS), 0)  # a 1-row step (10 ms) brings its first token
    refused = c.decide(Commitment("b", 1, 3, 10_000 * MS), 0)
    assert isinstance(refused, Admit)
    finishes = c.predictor.finish_times([c.commitments["a"]], 0)
    # the step in flight, then a's two tokens left at 10 ms each: 30 ms, as the device runs it
    assert finishes["a"] == 30 * MS


def test_a_long_prompt_is_priced_by_its_chunks_where_the_step_time_bends_up():
    cost = bending_up()
    predictor = Predictor(cost, AdmissionConfig(4, 256, margin_ms=0, margin_fraction=0))
    finish_ns = predictor.finish_times([Commitment("doc", 1000, 4, 10_000 * MS)], 0)["doc"]
    # as the device runs it: three 256-row chunks, then 232 rows with its first token, then 3 decode steps
    device_us = 3 * cost.raw_step_us(256) + cost.raw_step_us(232) + 3 * cost.raw_step_us(1)
    assert finish_ns >= device_us * 1000
    assert finish_ns <= 1.02 * device_us * 1000  # and not far above it
    # the marginal row of the batch (its second row's time, a row) would have said about a tenth of that
    assert 1000 * (cost.raw_step_us(2) - cost.raw_step_us(1)) * 1000 < 0.2 * finish_ns


@pytest.mark.parametrize("seed", [1, 2])
def test_cold_long_prompts_at_load_on_a_cpu_shaped_device_meet_every_deadline(seed):
    """1,000-token prompts, none cached, at about twice what a 4-slot replica serves: every admitted call
    finishes inside its deadline on a device that runs as calibrated."""
    c = controller(bending_up())
    tally = run(c, 2.0, 30.0, seed=seed, prompt_tokens=1000, max_tokens=16, budget_ms=1500, max_attempts=1)
    assert tally.num_admitted >= 10
    assert tally.misses == []
    assert tally.outcomes["first_reject"] > 0  # loaded: some were refused


def test_a_budget_only_the_marginal_row_would_meet_is_infeasible_at_once():
    """A lone cold 1,000-token prompt takes 1.2 s on this device: an 800-ms budget is refused before any step
    as infeasible, naming the budget that would do, rather than admitted on the marginal row's 0.2 s and missed."""
    c = controller(bending_up())
    tally = run(c, 0.5, 20.0, seed=1, prompt_tokens=1000, max_tokens=16, budget_ms=800, max_attempts=1)
    assert tally.num_admitted == 0 and tally.outcomes["first_infeasible"] > 0
    decision = c.decide(Commitment("doc", 1000, 16, 800 * MS), 0)
    assert isinstance(decision, Infeasible) and decision.min_budget_ms >= 1200
    fits = c.decide(Commitment("doc2", 1000, 16, decision.min_budget_ms * MS), 0)
    assert isinstance(fits, Admit)


def test_fifo_hears_steps_and_ignores_them():
    fifo = FifoAdmission()
    fifo.step_ended(5 * MS)
    assert fifo.decide(Commitment("a", 1, 1, 10 * MS), 6 * MS) == Admit(predicted_finish_ns=0)
    assert not isinstance(fifo.decide(Commitment("b", 1, 1, 10 * MS), 6 * MS), Reject)


def test_a_chunks_reads_of_earlier_positions_are_not_learnt_as_a_slow_device():
    """A chunk after a cached prefix (or after its prompt's earlier chunks) also reads those positions, which
    calibration measured apart (us_per_prefill_context_token): the step observer counts them in what the step
    should take, so the running ratio every prediction is scaled by stays at the device's speed."""
    cost = linear_cost()
    cost.us_per_prefill_context_token = 1.0
    stats = StepStats(cost, ServiceMetrics(), 4, StepLog())
    reads = 200 * 512  # a 200-row chunk after 512 positions
    step_ms = (cost.raw_step_us(200) + reads * 1.0) / 1000
    digest = StepDigest(0, int(step_ms * MS), True, (("a", 200),), 0, (), 1, 3, prefill_context_tokens=reads)
    for _ in range(20):
        stats.on_step(digest)
    assert cost.ratio == pytest.approx(1.0, abs=1e-6)


def test_the_scheduler_counts_the_positions_a_prompt_chunk_reads_before_it():
    chunk = ScheduledSeq(None, (), 512, tuple(range(200)), True)  # 200 rows from position 512
    decode = ScheduledSeq(None, (), 700, (1,), True)
    step = SchedulerOutput((decode,), (chunk,), ())
    assert step.prefill_context_tokens == 200 * 512 and step.context_tokens == 701
