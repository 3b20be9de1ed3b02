"""The pulse tool's statistics on synthetic traces with answers worked out by hand, and its schedules."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.pulse.schedule import LoadSpec, ShapeSpec, arrival_times, plan
from services.pulse.stats import RequestTrace, percentile, summarize, time_series

RE = "RESOURCE_EXHAUSTED"


def trace(
    i: int,
    attempts: list[tuple[float, str]],
    outcome: str,
    finished_after_s: float | None,
    first_token_after_s: float | None = None,
    deadline_met: bool | None = True,
    deadline_ms: float = 1000,
):
    sent = float(i)
    return RequestTrace(
        index=i,
        planned_s=sent,
        deadline_ms=deadline_ms,
        prompt_tokens=8,
        max_tokens=4,
        sent_s=sent,
        outcome=outcome,
        attempts=[(sent + dt, o) for dt, o in attempts],
        first_token_s=None if first_token_after_s is None else sent + first_token_after_s,
        finished_s=None if finished_after_s is None else sent + finished_after_s,
        completion_tokens=4 if outcome == "ok" else 0,
        server_deadline_met=deadline_met if outcome == "ok" else None,
    )


@pytest.fixture
def traces() -> list[RequestTrace]:
    out = [trace(i, [(0.0, "admitted")], "ok", 0.1 * (i + 1), first_token_after_s=0.01 * (i + 1)) for i in range(6)]
    out.append(trace(6, [(0.0, RE), (0.3, "admitted")], "ok", 0.5, first_token_after_s=0.35))
    out.append(trace(7, [(0.0, RE), (0.2, RE), (0.4, "admitted")], "ok", 0.9, first_token_after_s=0.45))
    out.append(trace(8, [(0.0, RE)], "rejected", 0.001))
    out.append(trace(9, [(0.0, "admitted")], "deadline_exceeded", 1.0))
    out.append(
        RequestTrace(index=10, planned_s=9.5, deadline_ms=1000, prompt_tokens=8, max_tokens=4, outcome="not_sent")
    )
    return out


def test_summary_of_a_known_trace(traces):
    s = summarize(traces, duration_s=10.0)
    assert (s.num_requests, s.num_sent, s.num_admitted, s.num_completed, s.num_in_deadline) == (11, 10, 9, 8, 8)
    assert s.outcomes == {"ok": 8, "rejected": 1, "deadline_exceeded": 1, "not_sent": 1}
    # call latencies 100..600, 500, 900 ms -> sorted 100 200 300 400 500 500 600 900
    assert (s.latency_ms.p50, s.latency_ms.p95, s.latency_ms.p99, s.latency_ms.max) == pytest.approx(
        (400, 900, 900, 900)
    )
    # admitted latencies 100..600, 200, 500 -> sorted 100 200 200 300 400 500 500 600
    assert (s.admitted_latency_ms.p50, s.admitted_latency_ms.p99) == pytest.approx((300, 600))
    assert s.p99_over_p50 == pytest.approx(2.0)
    # TTFT from the call's start: 10..60 ms, 350, 450
    assert (s.ttft_ms.p50, s.ttft_ms.max) == pytest.approx((40, 450))
    # TTFT from the admitted attempt: 10..60, 50, 50 -> sorted 10 20 30 40 50 50 50 60
    assert (s.admitted_ttft_ms.p50, s.admitted_ttft_ms.max) == pytest.approx((40, 60))
    assert s.rejection_rate == pytest.approx(3 / 10)  # 6, 7 and 8 were refused at first
    assert s.attempt_rejection_rate == pytest.approx(4 / 13)
    assert s.avg_retries_per_rejected == pytest.approx((1 + 2 + 0) / 3)
    assert s.first_retry_success_rate == pytest.approx(1 / 2)  # 6 got in at its retry, 7 did not
    assert s.goodput_rps == pytest.approx(8 / 10)
    assert s.num_admitted_misses == 1 and s.admitted_miss_rate == pytest.approx(1 / 9)
    assert s.mean_completion_tokens == 4 and s.max_dispatch_lag_ms == 0


def test_a_completion_past_its_deadline_is_no_goodput_and_an_admitted_miss():
    late_by_client = trace(0, [(0.0, "admitted")], "ok", 1.2)  # 1200 ms > 1000 ms
    late_by_server = trace(1, [(0.0, "admitted")], "ok", 0.5, deadline_met=False)
    fine = trace(2, [(0.0, "admitted")], "ok", 0.5)
    s = summarize([late_by_client, late_by_server, fine], duration_s=4.0)
    assert s.num_completed == 3 and s.num_in_deadline == 1
    assert s.goodput_rps == pytest.approx(0.25) and s.num_admitted_misses == 2


def test_the_replicas_own_latency_spread_is_reported_beside_the_clients():
    # the client saw 100..400 ms; the replica says 80, 90, 100 and 300 ms (the rest was the client's own lag)
    done = [trace(i, [(0.0, "admitted")], "ok", 0.1 * (i + 1)) for i in range(4)]
    for t, server_ms in zip(done, (80, 90, 100, 300)):
        t.server_total_us = server_ms * 1000
    unknown = trace(4, [(0.0, "admitted")], "ok", 0.5)  # a reply without timings counts for the client only
    s = summarize([*done, unknown], duration_s=5.0)
    assert s.p99_over_p50 == pytest.approx(500 / 300)
    assert (s.server_latency_ms.p50, s.server_latency_ms.p99, s.server_latency_ms.count) == (90, 300, 4)
    assert s.server_p99_over_p50 == pytest.approx(300 / 90)
    assert summarize([unknown], duration_s=1.0).server_p99_over_p50 is None


def test_the_lag_from_engine_finish_to_the_clients_read_is_summarized():
    done = [trace(i, [(0.0, "admitted")], "ok", 0.2) for i in range(3)]
    for t, lag_us in zip(done, (4_000, 9_000, 150_000)):
        t.final_lag_us = lag_us
    refused = trace(3, [(0.0, "RESOURCE_EXHAUSTED")], "rejected", 0.01)
    refused.final_lag_us = 1  # only completed calls read a final message
    s = summarize([*done, refused], duration_s=1.0)
    assert (s.final_lag_ms.p50, s.final_lag_ms.p99, s.final_lag_ms.count) == (9, 150, 3)


def test_empty_and_rejection_free_runs_have_no_ratios_to_report():
    s = summarize([trace(0, [(0.0, "admitted")], "ok", 0.2)], duration_s=1.0)
    assert s.rejection_rate == 0 and s.avg_retries_per_rejected is None and s.first_retry_success_rate is None
    empty = summarize([], duration_s=1.0)
    assert empty.latency_ms.p50 is None and empty.p99_over_p50 is None and empty.goodput_rps == 0


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=200), st.sampled_from([50, 95, 99, 100]))
def test_percentile_is_nearest_rank(values, p):
    assert percentile(values, p) == np.percentile(values, p, method="inverted_cdf")


def test_time_series_counts_each_event_in_its_bin(traces):
    series = time_series(traces, duration_s=10.0, bin_s=1.0)
    assert len(series["bin_start_s"]) == 11  # the last call (9) ends at 10.0 s
    assert sum(series["arrivals"]) == 11 and series["arrivals"][9] == 2  # 9 and the unsent 10
    assert sum(series["admissions"]) == 9 and sum(series["rejections"]) == 4
    assert series["rejections"][7] == 2 and series["completions"][7] == 1  # 7 finished at 7.9 s
    assert sum(series["completions"]) == 8


def test_constant_arrivals_are_evenly_spaced():
    times = arrival_times(LoadSpec(qps=10, duration_s=2, arrival="constant"), random.Random(0))
    assert times == pytest.approx([0.05 + 0.1 * i for i in range(20)])


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    load = LoadSpec(qps=50, duration_s=200, seed=3)
    times = arrival_times(load, random.Random(3))
    assert times == arrival_times(load, random.Random(3)) and times == sorted(times)
    assert len(times) == pytest.approx(50 * 200, rel=0.03)
    gaps = np.diff(times)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.05)  # exponential gaps: CV of 1


def test_bursts_multiply_the_rate_for_their_length():
    load = LoadSpec(qps=10, duration_s=20, arrival="constant", pulse_factor=4, pulse_s=1, pulse_every_s=10)
    assert load.segments() == [(0, 4.5, 10), (4.5, 5.5, 40), (5.5, 14.5, 10), (14.5, 15.5, 40), (15.5, 20, 10)]
    times = arrival_times(load, random.Random(0))
    assert len(times) == 10 * 18 + 40 * 2
    assert sum(1 for t in times if 4.5 <= t < 5.5) == 40 and sum(1 for t in times if 0 <= t < 1) == 10
    assert load.rate_at(5.0) == 40 and load.rate_at(6.0) == 10


def test_burst_arrivals_send_a_periods_worth_at_once_every_period():
    load = LoadSpec(qps=6, duration_s=25, arrival="burst", pulse_every_s=10)
    times = arrival_times(load, random.Random(0))
    assert load.burst_size == 60 and times == [0.0] * 60 + [10.0] * 60 + [20.0] * 60


def test_stages_ramp_up_hold_and_ramp_down_with_the_asked_rate_on_the_plateau():
    load = LoadSpec(qps=40, duration_s=80, arrival="stages", seed=5)
    segments = load.segments()
    assert segments[0] == (0.0, 2.5, 5.0) and segments[7] == (17.5, 20.0, 40.0)
    assert segments[8] == (20.0, 60.0, 40.0) and segments[-1] == (77.5, 80.0, 5.0)
    assert [b for _, b, _ in segments[:-1]] == [a for a, _, _ in segments[1:]]  # no gap, no overlap
    times = arrival_times(load, random.Random(5))
    plateau = sum(1 for t in times if 20 <= t < 60)
    assert plateau == pytest.approx(40 * 40, rel=0.06)
    assert sum(1 for t in times if t < 5) < sum(1 for t in times if 15 <= t < 20) / 3  # still ramping
    assert len(times) == pytest.approx(40 * 40 + 2 * 40 * 20 * 9 / 16, rel=0.06)  # the ramps: 9/16 of full rate


def test_plans_are_reproducible_and_shapes_fit_the_context():
    load = LoadSpec(qps=20, duration_s=5, seed=7)
    fixed = plan(load, ShapeSpec("fixed", 24, 8), vocab_size=300, deadline_ms=900, deadline_per_token_ms=10)
    assert fixed == plan(load, ShapeSpec("fixed", 24, 8), vocab_size=300, deadline_ms=900, deadline_per_token_ms=10)
    assert all(len(r.prompt_token_ids) == 24 and r.max_tokens == 8 and r.deadline_ms == 980 for r in fixed)
    assert all(16 <= t < 300 for r in fixed for t in r.prompt_token_ids)
    mix = plan(
        LoadSpec(qps=200, duration_s=5, seed=7),
        ShapeSpec("mix", 100, 50, sigma=1.5, context_length=256),
        vocab_size=300,
        deadline_ms=900,
    )
    assert len({len(r.prompt_token_ids) for r in mix}) > 20 and len({r.max_tokens for r in mix}) > 20
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 256 and r.max_tokens >= 1 for r in mix)


@pytest.mark.parametrize(
    "bad",
    [
        dict(qps=0, duration_s=1),
        dict(qps=1, duration_s=1, arrival="bursty"),
        dict(qps=1, duration_s=1, pulse_s=20, pulse_every_s=10),
    ],
)
def test_bad_load_specs_are_refused(bad):
    with pytest.raises(ValueError):
        LoadSpec(**bad)
