"""Expiry in the engine: a request ends before a step only if its deadline falls inside that step, forecast from the
step's own rows at the speed this engine's steps have run; a long step before it (a prompt's prefill) does not end
calls that have time for their next tokens."""

from __future__ import annotations

import pytest

from services.inference.cost.model import CostModel
from services.inference.engine.engine import Engine
from services.inference.sched.request import RequestStatus
from tests.inference.conftest import Collector, make_engine, request

MS = 1_000_000


class FakeClock:
    def __init__(self) -> None:
        self.now_ns = 10**12

    def __call__(self) -> int:
        return self.now_ns


class TimedExecutor:
    """The real executor, on a clock that each step advances by `ms_per_row` per row."""

    def __init__(self, executor, clock: FakeClock, ms_per_row: float) -> None:
        self.executor, self.clock, self.ms_per_row = executor, clock, ms_per_row

    def run(self, scheduled):
        self.clock.now_ns += int(scheduled.num_tokens * self.ms_per_row * MS)
        return self.executor.run(scheduled)

    def __getattr__(self, name):
        return getattr(self.executor, name)


def timed_engine(llama_dir, step_cost: CostModel | None, ms_per_row: float = 1.0) -> tuple[Engine, FakeClock]:
    real = make_engine(llama_dir, max_batch=4)
    clock = FakeClock()
    engine = Engine(
        TimedExecutor(real.executor, clock, ms_per_row),
        real.tokenizer,
        (),
        max_num_batched_tokens=256,
        clock=clock,
        step_cost=step_cost,
    )
    return engine, clock


def calibration() -> CostModel:
    """1 ms a row, as TimedExecutor runs at ms_per_row=1: the calibration this fake device was measured at."""
    return CostModel([1, 64], [1000.0, 64000.0], 0.0)


def run(engine: Engine, num_steps: int) -> None:
    for _ in range(num_steps):
        engine.step()


def test_after_a_long_prefill_a_call_with_time_for_its_next_tokens_is_not_ended(llama_dir):
    engine, clock = timed_engine(llama_dir, calibration())
    sink = Collector()
    # a 40-token prompt fills in one 40-ms step; then 10 ms are left, room for ten 1-ms decode steps
    call = request("a", list(range(3, 43)), deadline_ns=clock.now_ns + 50 * MS, max_tokens=3, ignore_eos=True)
    engine.add_request(call, sink)
    run(engine, 3)
    assert sink.finish_reason("a") == "length" and len(sink.tokens("a")) == 3
    assert clock.now_ns <= call.deadline_ns  # it did finish in time


def test_a_call_whose_deadline_falls_inside_the_next_step_ends_before_it(llama_dir):
    engine, clock = timed_engine(llama_dir, calibration())
    sink = Collector()
    call = request("b", list(range(3, 43)), deadline_ns=clock.now_ns + 40 * MS + MS // 2, max_tokens=3, ignore_eos=True)
    engine.add_request(call, sink)
    run(engine, 2)  # its prefill, then a 1-ms decode step it would end half a ms past its deadline
    assert call.status == RequestStatus.FINISHED_EXPIRED and sink.finish_reason("b") == "deadline_exceeded"
    assert len(sink.tokens("b")) == 1


def test_the_forecast_follows_the_speed_the_steps_really_ran_at(llama_dir):
    # the device runs at 3 ms a row, three times its calibration: a decode step is forecast at ~3 ms, not 1
    engine, clock = timed_engine(llama_dir, calibration(), ms_per_row=3.0)
    sink = Collector()
    warm = request("warm", list(range(3, 43)), max_tokens=100, ignore_eos=True)
    engine.add_request(warm, sink)
    run(engine, 60)  # the running ratio learns the slower speed
    call = request("c", [5, 6], deadline_ns=clock.now_ns + 7 * MS, max_tokens=5, ignore_eos=True)
    engine.add_request(call, sink)
    run(engine, 1)  # its prefill and warm's decode: 3 rows, 9 ms
    assert call.status == RequestStatus.FINISHED_EXPIRED  # 7 ms < 9: ended before the step, not after
    assert engine.expiry_guard() == pytest.approx(3 * MS, rel=0.25)  # warm decodes alone: one row at ~3 ms


def test_an_uncalibrated_engine_keeps_the_service_guard_and_the_last_step(llama_dir):
    engine, clock = timed_engine(llama_dir, None)
    engine.set_expiry_guard(2 * MS)
    sink = Collector()
    call = request("d", list(range(3, 43)), deadline_ns=clock.now_ns + 50 * MS, max_tokens=3, ignore_eos=True)
    engine.add_request(call, sink)
    run(engine, 2)  # 1.5 x the 40-ms prefill step is past its 10 ms left: without a forecast, it ends
    assert sink.finish_reason("d") == "deadline_exceeded"


def test_a_device_that_has_just_slowed_down_is_forecast_at_its_last_step(llama_dir):
    engine, clock = timed_engine(llama_dir, calibration())
    sink = Collector()
    warm = request("warm", list(range(3, 43)), max_tokens=100, ignore_eos=True)
    engine.add_request(warm, sink)
    run(engine, 20)  # steps as calibrated: the running ratio is 1
    engine.executor.ms_per_row = 10.0  # now ten times slower
    run(engine, 1)
    # the running ratio has barely moved (0.05 a step); the last step says 10 ms a decode step
    assert engine.step_cost.ratio < 1.5 and engine.expiry_guard() == pytest.approx(10 * MS, rel=0.05)
    call = request("e", list(range(3, 43)), deadline_ns=clock.now_ns + 100 * MS, max_tokens=5, ignore_eos=True)
    engine.add_request(call, sink)
    run(engine, 1)  # its 40-row prefill beside warm's decode: 410 ms at the new speed, 60 at the running ratio
    assert call.status == RequestStatus.FINISHED_EXPIRED
