"""Paced steps (--pace-tokens): the floor, the engine idling it out, the meter leaving it unbilled, the cost model
and admission predicting the padded step. Clocks and sleeps are fakes: no timing is asserted."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.inference.admission import AdmissionConfig, Commitment, Predictor
from services.inference.cost.model import CostModel
from services.inference.device.executor import Executor, ExecutorConfig
from services.inference.device.loader import load_checkpoint
from services.inference.engine.core import build_engine
from services.inference.engine.digest import StepDigest, step_wire
from services.inference.engine.engine import Engine
from services.inference.engine.messages import EngineSpec
from services.inference.engine.pacing import Pacer
from services.inference.metrics import ServiceMetrics, StepLog, StepStats
from services.inference.sched.request import Request, SamplingParams
from tests.inference.test_meter import Recorder, make_meter, register, req

MS = 1_000_000


def linear_cost(us_per_row=100.0, base_us=200.0):
    """T(rows) = base + rows × us_per_row; no context cost; no inflation."""
    return CostModel(
        rows=[1, 256],
        row_us=[base_us + us_per_row, base_us + 256 * us_per_row],
        us_per_context_token=0.0,
        num_deviations=0.0,
        deviation=0.0,
    )


class FakeTime:
    """A clock that moves 10 µs per reading and by exactly what is slept."""

    def __init__(self) -> None:
        self.now_ns, self.slept_s = 0, []

    def clock(self) -> int:
        self.now_ns += 10_000
        return self.now_ns

    def sleep(self, seconds: float) -> None:
        self.slept_s.append(seconds)
        self.now_ns += int(seconds * 1e9)


def test_the_floor_is_a_step_with_one_more_prompt_chunk():
    pacer = Pacer(linear_cost(), chunk_tokens=16)
    assert pacer.floor_ns(num_seqs=3, context_tokens=0) == (200 + 19 * 100) * 1000
    with pytest.raises(ValueError):
        Pacer(linear_cost(), chunk_tokens=0)


def test_only_steps_with_prompt_tokens_scale_the_floor():
    pacer = Pacer(linear_cost(), chunk_tokens=16)
    for _ in range(300):  # decode-only steps three times slower than calibrated: they do not count
        pacer.observe(num_tokens=4, num_prompt_tokens=0, context_tokens=0, interval_ns=3 * 600 * 1000)
    assert pacer.ratio == 1.0
    for _ in range(300):  # steps with a chunk 1.5x slower than calibrated (as they run paced)
        pacer.observe(num_tokens=20, num_prompt_tokens=16, context_tokens=0, interval_ns=int(1.5 * 2200 * 1000))
    assert pacer.ratio == pytest.approx(1.5, rel=1e-3)
    assert pacer.floor_ns(4, 0) == pytest.approx(1.5 * 2200 * 1000, rel=1e-3)


def test_idle_out_sleeps_what_is_left_of_the_floor_and_never_past_it():
    fake = FakeTime()
    pacer = Pacer(linear_cost(), chunk_tokens=8, sleep=fake.sleep)
    fake.now_ns = 400_000
    assert pacer.idle_out(began_ns=0, floor_ns=1_000_000, clock=fake.clock) == 590_000 + 10_000
    assert fake.slept_s == [pytest.approx(590e-6)]
    assert pacer.idle_out(began_ns=0, floor_ns=500_000, clock=fake.clock) == 0  # the step ran past its floor
    assert len(fake.slept_s) == 1


@pytest.fixture()
def paced_engine(llama_dir):
    fake = FakeTime()
    checkpoint = load_checkpoint(llama_dir, dtype="float32")
    engine = Engine(
        Executor(checkpoint, ExecutorConfig(max_batch=4, max_seq_len=128)),
        checkpoint.tokenizer,
        checkpoint.eos_token_ids,
        clock=fake.clock,
        pacer=Pacer(linear_cost(), chunk_tokens=8, sleep=fake.sleep),
    )
    return engine, fake


class Keep:
    def __init__(self) -> None:
        self.digests: list[StepDigest] = []

    def on_step(self, digest: StepDigest) -> None:
        self.digests.append(digest)

    def put(self, output) -> None:
        pass


def test_a_paced_engine_idles_between_steps_and_reports_it_with_the_next_step(paced_engine):
    engine, fake = paced_engine
    keep = Keep()
    engine.observers.append(keep)
    for i, max_tokens in enumerate((3, 6)):
        engine.add_request(
            Request(f"r{i}", (5, 6, 7, 8), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), 0),
            keep,
        )
    while engine.has_work:
        report = engine.step()
        engine.pace(report)
        if report.num_unfinished:  # the expiry guard sees the cadence, not just the work
            assert engine.last_interval_ns >= engine.pacer.floor_ns(report.scheduled.num_seqs, 0)
    digests = keep.digests
    assert len(digests) == 6 and not digests[0].paced_ns  # nothing idled before the first step
    # every step but the last (nothing left to run) idled out its floor: a step of its sequences plus 8 tokens
    assert len(fake.slept_s) == 5
    for before, after, slept_s in zip(digests, digests[1:], fake.slept_s):
        floor_ns = engine.pacer.floor_ns(len(before.work), before.context_tokens)
        assert after.paced_ns == pytest.approx(slept_s * 1e9, abs=10_000)
        assert after.began_ns - before.began_ns >= floor_ns


def test_the_wire_carries_the_idle_before_a_step(paced_engine):
    engine, _ = paced_engine
    keep = Keep()
    engine.observers.append(keep)
    engine.add_request(Request("r", (5, 6), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), 0), keep)
    shipped = []
    while engine.has_work:
        report = engine.step()
        shipped.append(StepDigest.from_wire(step_wire(report, engine.scheduler.num_free_slots)))
        engine.pace(report)
    assert shipped == keep.digests and [d.paced_ns > 0 for d in shipped] == [False, True, True]


def test_the_meter_counts_paced_idle_as_idle_and_still_accounts_all_wall_time():
    rec = Recorder()
    meter = make_meter(rec)
    a = req("a")
    register(meter, a)
    meter.on_step(StepDigest(0, 1 * MS, True, (("a", 4),), 0, (), 1, 0))
    # 3 ms between the steps: 2.5 ms idled out on purpose, then 0.5 ms of host work before the step began
    meter.on_step(StepDigest(4 * MS, 5 * MS, True, (("a", 1),), 0, (), 0, 0, paced_ns=int(2.5 * MS)))
    assert meter.billed_unit_us == 2 * (1000 + 500 + 1000)
    assert meter.idle_unit_us == 2 * 2500
    assert meter.billed_unit_us + meter.idle_unit_us == meter.wall_unit_us
    assert meter.usage_unit_us == {"a": meter.billed_unit_us}


def test_paced_step_stats_teach_the_cost_model_the_period_of_the_padded_step():
    cost = linear_cost()
    stats = StepStats(cost, ServiceMetrics(), 4, StepLog(), pace_tokens=16)

    def step(began_ms, interval_ms, paced_ms, seqs=2):
        return StepDigest(
            int(began_ms * MS),
            int((began_ms + interval_ms) * MS),
            True,
            tuple((f"r{i}", 1) for i in range(seqs)),
            0,
            (),
            seqs,
            0,
            int(paced_ms * MS),
        )

    # periods of exactly the padded step's calibrated time (200 + 18 × 100 µs): 0.6 ms of work, 1.4 ms idle
    began = 0.0
    for _ in range(200):
        stats.on_step(step(began, 0.6, 1.4 if began else 0.0))
        began += 2.0
    assert cost.num_observed == 199 and cost.ratio == pytest.approx(1.0, abs=1e-3)
    unpaced = linear_cost()
    StepStats(unpaced, ServiceMetrics(), 4, StepLog()).on_step(step(0, 0.6, 0))
    assert unpaced.ratio > 1.0  # unpaced, its 0.6 ms reads against the unpadded step's 0.4 ms


def test_paced_admission_predicts_padded_steps_and_absorbs_a_chunk_sized_prompt():
    cost = linear_cost()
    paced = Predictor(cost, AdmissionConfig(4, 256, pace_tokens=16))
    unpaced = Predictor(cost, AdmissionConfig(4, 256))
    running = [Commitment("a", 8, 10, 10**12, num_generated=1)]
    new = Commitment("b", 16, 10, 10**12)
    # paced: 9 steps of 2 sequences and 1 of b alone, each padded by 16 rows; b's 16-token prompt fits the padding
    assert paced.finish_times([*running, new], 0)["b"] == (9 * (200 + 18 * 100) + (200 + 17 * 100)) * 1000
    # unpaced: the same steps unpadded, plus what its prompt's chunk adds (its last row is its row of the step)
    assert unpaced.finish_times([*running, new], 0)["b"] == (15 * 100 + 9 * (200 + 2 * 100) + 300) * 1000
    longer = Commitment("c", 40, 10, 10**12)  # 23 rows past the padding (and its own row) cost their chunk's time
    assert paced.finish_times([*running, longer], 0)["c"] == (23 * 100 + 9 * 2000 + 1900) * 1000


def test_paced_steps_need_the_calibrated_cost_model(llama_dir):
    spec = EngineSpec(
        str(llama_dir), "float32", ExecutorConfig(max_batch=2, max_seq_len=64), 64, calibrate=False, pace_tokens=8
    )
    with pytest.raises(ValueError, match="calibrated"):
        build_engine(spec)


def test_serve_refuses_a_negative_pace():
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "--pace-tokens", "-1"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "--pace-tokens: must be 0 or more" in result.stderr


def test_the_step_period_is_start_to_start_while_calls_stay_in_flight():
    metrics = ServiceMetrics()
    stats = StepStats(None, metrics, 4, StepLog())

    def step(began_ms, unfinished):
        return StepDigest(int(began_ms * MS), int((began_ms + 0.5) * MS), True, (("r", 1),), 0, (), unfinished, 0)

    for digest in (step(0, 1), step(2, 0), step(50, 1), step(51.5, 1)):  # idle between 2.5 and 50 ms: no period
        stats.on_step(digest)
    count = metrics.registry.get_sample_value("zeroqueue_step_period_seconds_count")
    total = metrics.registry.get_sample_value("zeroqueue_step_period_seconds_sum")
    assert count == 2 and total == pytest.approx(0.0035)
