"""A prompt chunk's reads of the positions before it (a cached prefix, its prompt's earlier chunks) are counted
where they happen: the scheduler counts them, and the step observer adds their calibrated time to what the step
should take, so the running ratio every prediction is scaled by is not taught a slow device. No torch."""

from __future__ import annotations

import pytest

from services.inference.cost.model import CostModel
from services.inference.engine.digest import StepDigest
from services.inference.metrics import ServiceMetrics, StepLog, StepStats
from services.inference.sched.scheduler import ScheduledSeq, SchedulerOutput

MS = 1_000_000


def linear_cost() -> CostModel:
    """A step of r rows takes 9 ms + 1 ms a row."""
    return CostModel([1, 256], [10_000.0, 265_000.0], 0.0, num_deviations=0, deviation=0)


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
