"""The knee search of `zeroqueue pulse --capacity`, against synthetic replicas with a known refusal curve."""

from __future__ import annotations

import pytest

from services.pulse.capacity import Probe, confirm_knee, find_knee
from services.pulse.scrape import server_view


def replica(knee_qps: float):
    """Refuses nothing below the knee and a growing share above it; remembers what it was probed at."""
    probed: list[float] = []

    def probe(qps: float) -> Probe:
        probed.append(qps)
        refused = 0.0 if qps <= knee_qps else min((qps - knee_qps) / knee_qps, 1.0)
        return Probe(qps, refused, qps * (1 - refused))

    return probe, probed


def test_bisection_lands_on_the_highest_probed_rate_that_passes():
    probe, probed = replica(knee_qps=41.0)
    capacity, probes = find_knee(probe, 30.0, 60.0, target=0.02, num_probes=6)
    assert len(probes) == 6 and probed[:2] == [30.0, 60.0]
    rate_at_target = 41.0 * 1.02  # refuses exactly 2 %
    assert rate_at_target - 30.0 / 2**4 <= capacity <= rate_at_target  # four halvings of [30, 60] after both ends
    assert capacity == max(p.qps for p in probes if p.rejection_rate <= 0.02)


def test_an_upper_bound_that_passes_is_doubled_until_one_refuses_too_many():
    # a closed-loop saturation below the knee (a host with long steps): the search must not stop under it
    probe, probed = replica(knee_qps=25.0)
    capacity, probes = find_knee(probe, 5.0, 10.0, target=0.02, num_probes=7)
    assert probed[:4] == [5.0, 10.0, 20.0, 40.0]  # 40 refuses 60 %: the bisection is on [20, 40]
    assert 25.5 - 20.0 / 2**3 <= capacity <= 25.5
    assert capacity == max(p.qps for p in probes if p.rejection_rate <= 0.02)


def test_a_lower_bound_that_already_refuses_too_much_is_halved_first():
    probe, probed = replica(knee_qps=10.0)
    capacity, probes = find_knee(probe, 30.0, 60.0, target=0.02, num_probes=6)
    assert probed[:3] == [30.0, 15.0, 7.5]  # 15 refused too many: it is not probed again
    assert probed[3] == (7.5 + 15.0) / 2
    assert 7.5 <= capacity <= 10.2


def test_no_rate_that_passes_is_an_error_naming_the_probes():
    probe, _ = replica(knee_qps=0.1)
    with pytest.raises(RuntimeError, match="30.00 req/s refused"):
        find_knee(probe, 30.0, 60.0, target=0.02, num_probes=3)


def test_a_knee_that_a_long_run_refutes_is_lowered_until_one_passes():
    probe, probed = replica(knee_qps=40.0)  # the short probes passed 41.0; the long runs say 40.0
    capacity, runs, confirmed = confirm_knee(probe, 41.0, target=0.0, num_runs=3)
    assert confirmed and probed == [41.0, 41.0 * 0.95] and capacity == 41.0 * 0.95
    assert [r.rejection_rate > 0 for r in runs] == [True, False]


def test_a_knee_inside_the_band_is_kept_after_one_run():
    probe, probed = replica(knee_qps=40.0)  # 40.4 refuses 1 %
    assert confirm_knee(probe, 40.4, target=0.02, num_runs=3, floor=0.005)[::2] == (40.4, True)
    assert probed == [40.4]


def test_a_knee_refusing_too_few_is_raised_into_the_band():
    probe, probed = replica(knee_qps=40.0)  # 39.5 refuses nothing, 39.5 × 1.03 = 40.685 refuses 1.7 %
    capacity, runs, confirmed = confirm_knee(probe, 39.5, target=0.02, num_runs=4, floor=0.005)
    assert confirmed and probed == pytest.approx([39.5, 40.685]) and capacity == probed[-1]


def test_raising_stops_short_of_a_rate_that_refused_too_many():
    probe, probed = replica(knee_qps=40.0)
    # 41 refuses 2.5 %: down to 38.95 (0 %), then 3 % up would reach 40.12 < 41: tried (0.3 %, under the floor),
    # then 3 % more would pass 41: stop, with the highest rate that passed
    capacity, runs, confirmed = confirm_knee(probe, 41.0, target=0.02, num_runs=5, floor=0.005)
    assert not confirmed and probed == pytest.approx([41.0, 38.95, 40.1185])
    assert capacity == pytest.approx(40.1185)


def test_when_no_confirmation_passes_the_last_rate_tried_is_flagged():
    probe, probed = replica(knee_qps=10.0)
    capacity, runs, confirmed = confirm_knee(probe, 40.0, target=0.02, num_runs=3)
    assert not confirmed and len(runs) == 3 and capacity == pytest.approx(40.0 * 0.95**2) == probed[-1]


def test_the_server_view_reports_how_many_calls_joined_the_very_next_step():
    name = "zeroqueue_steps_waited"
    before = {
        (f"{name}_count", ()): 10.0,
        (f"{name}_sum", ()): 2.0,
        (f"{name}_bucket", (("le", "0.0"),)): 8.0,
        (f"{name}_bucket", (("le", "1.0"),)): 10.0,
        (f"{name}_bucket", (("le", "+Inf"),)): 10.0,
    }
    after = {
        (f"{name}_count", ()): 110.0,
        (f"{name}_sum", ()): 5.0,
        (f"{name}_bucket", (("le", "0.0"),)): 105.0,
        (f"{name}_bucket", (("le", "1.0"),)): 109.0,
        (f"{name}_bucket", (("le", "+Inf"),)): 110.0,
    }
    waited = server_view(before, after)["steps_waited"]
    assert waited["count"] == 100 and waited["next_step_share"] == pytest.approx(0.97)
    assert waited["mean"] == pytest.approx(0.03) and waited["max_at_most"] == float("inf")


class _Refusing:
    """An AsyncClient whose every call is refused OVERLOADED with a 300-ms hint; counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def generate(self, prompt, deadline_ms, **options):
        import grpc

        from services.client import Rejected
        from services.client.failure import Failure
        from services.client.results import AttemptRecord, CallReport

        self.calls += 1
        attempt = AttemptRecord(
            0, "fake:1", "", 0.0, deadline_ms / 1000, 0.0, "", "RESOURCE_EXHAUSTED", "OVERLOADED", retry_after_ms=300
        )
        error = Rejected(
            Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", "OVERLOADED", retry_after_ms=300),
            CallReport(options["request_id"], (attempt,), 0.001, "deadline"),
        )

        class Generation:
            report = error.report

            def __aiter__(self):
                return self

            async def __anext__(self):
                raise error

        return Generation()


def test_a_closed_loop_caller_waits_out_a_refusal_hint_before_its_next_call():
    import asyncio

    from services.pulse.runner import run_closed_loop
    from services.pulse.schedule import PlannedRequest

    client = _Refusing()
    traces = asyncio.run(
        run_closed_loop(
            client,
            lambda i: PlannedRequest(i, 0.0, (5, 6), 4, 2_000.0),
            concurrency=2,
            duration_s=0.75,
            id_prefix="cap",
        )
    )
    # two callers, each refused every 300 ms for 0.75 s: 3 calls each (at 0, 0.3, 0.6 s; 2 if the sleeps ran
    # long), where callers that resent at once would have made thousands
    assert 4 <= client.calls == len(traces) <= 6
    assert all(t.outcome == "rejected" and t.retry_after_ms == 300 for t in traces)
