"""The retrier on its own: a fake clock, a fake wall clock and fixed randomness, no network."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.client.failure import Failure
from services.client.retry import GiveUp, Retrier, Retry, RetryConfig

NOW_WALL_S = 1_800_000_000.0


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def retrier(num_endpoints=1, rand=0.0, **config) -> tuple[Retrier, FakeClock]:
    clock = FakeClock()
    return Retrier(RetryConfig(**config), num_endpoints, clock, lambda: NOW_WALL_S, lambda: rand), clock


def overloaded(hint_ms: int | None, skew_s: float = 0.0) -> Failure:
    return Failure(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "busy",
        "OVERLOADED",
        retry_after_ms=hint_ms,
        server_time_us=int((NOW_WALL_S + skew_s) * 1e6),
    )


def attempt(p: Retrier, state, endpoint: int, failure: Failure):
    state.num_attempts += 1
    return p.after_failure(state, endpoint, failure)


@given(hint_ms=st.integers(1, 60_000), rand=st.floats(0, 1, exclude_max=True))
def test_the_wait_is_the_hint_plus_a_bounded_jitter(hint_ms, rand):
    p, _ = retrier(rand=rand)
    state = p.start(deadline_ms=10**7, model="")
    decision = attempt(p, state, 0, overloaded(hint_ms))
    jitter_ms = min(20.0, 0.1 * hint_ms)
    assert isinstance(decision, Retry) and decision.reason == "hint"
    assert hint_ms / 1000 <= decision.delay_s <= (hint_ms + jitter_ms) / 1000


def test_skew_backoff_doubles_up_to_its_cap_with_full_jitter():
    p, _ = retrier(rand=0.999999, backoff_base_ms=10, backoff_max_ms=50)
    state = p.start(deadline_ms=10**7, model="")
    delays = [attempt(p, state, 0, overloaded(5_000, skew_s=30)).delay_s for _ in range(5)]
    assert delays == pytest.approx([0.010, 0.020, 0.040, 0.050, 0.050], rel=1e-5)
    p0, _ = retrier(rand=0.0)
    assert attempt(p0, p0.start(1000, ""), 0, overloaded(5_000, skew_s=30)).delay_s == 0.0


def test_a_rejection_without_a_hint_backs_off():
    p, _ = retrier(rand=0.5)
    decision = attempt(p, p.start(1_000, ""), 0, overloaded(None))
    assert decision == Retry(0, 0.0125, "no_hint")


def test_no_attempt_is_planned_past_the_deadline_or_with_a_sliver_of_budget_left():
    p, clock = retrier(min_attempt_budget_ms=5)
    state = p.start(deadline_ms=500, model="")
    assert attempt(p, state, 0, overloaded(494)) == Retry(0, 0.494, "hint")
    assert attempt(p, state, 0, overloaded(496)) == GiveUp("deadline")
    clock.now_s += 0.4
    assert attempt(p, state, 0, overloaded(120)) == GiveUp("deadline")


def test_never_retries_an_admitted_call_or_a_non_retryable_code():
    p, _ = retrier(num_endpoints=2)
    state = p.start(1_000, "")
    admitted = Failure(grpc.StatusCode.UNAVAILABLE, "gone", after_admission=True)
    assert attempt(p, state, 0, admitted) == GiveUp("after_admission")
    for code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.CANCELLED,
    ):
        assert attempt(p, state, 0, Failure(code, "no")) == GiveUp("not_retryable")


def test_the_attempt_limit_counts_the_first_try():
    p, _ = retrier(max_attempts=2)
    state = p.start(10_000, "")
    assert isinstance(attempt(p, state, 0, overloaded(10)), Retry)
    assert attempt(p, state, 0, overloaded(10)) == GiveUp("max_attempts")


def test_new_calls_round_robin_over_free_endpoints_and_avoid_busy_ones():
    p, clock = retrier(num_endpoints=3)
    assert [p.first_endpoint() for _ in range(4)] == [0, 1, 2, 0]
    attempt(p, p.start(10_000, ""), 1, overloaded(300))  # 1 is busy for 300 ms
    assert [p.first_endpoint() for _ in range(4)] == [2, 0, 2, 0]
    attempt(p, p.start(10_000, ""), 0, overloaded(100))
    attempt(p, p.start(10_000, ""), 2, overloaded(200))
    assert p.first_endpoint() == 0  # all busy: the one that frees first
    clock.now_s += 0.301
    assert sorted(p.first_endpoint() for _ in range(3)) == [0, 1, 2]


def test_busy_state_is_shared_by_all_calls_of_a_client():
    p, _ = retrier(num_endpoints=2)
    attempt(p, p.start(10_000, ""), 0, overloaded(400))
    other_call = p.start(10_000, "")
    assert attempt(p, other_call, 1, overloaded(50)) == Retry(1, 0.05, "hint")


def test_an_endpoint_that_keeps_failing_is_skipped_longer_and_forgiven_once_it_serves():
    p, clock = retrier(num_endpoints=2, rand=0.0)
    down = Failure(grpc.StatusCode.UNAVAILABLE, "refused")
    state = p.start(60_000, "")
    spans = []
    for _ in range(3):
        attempt(p, state, 0, down)
        spans.append(p.board.free_at_s[0] - clock.now_s)
    assert spans == pytest.approx([0.0125, 0.025, 0.05])  # half the cap: equal jitter at rand 0
    p.on_admitted(0)
    attempt(p, state, 0, down)
    assert p.board.free_at_s[0] - clock.now_s == pytest.approx(0.0125)


def test_no_room_within_the_budget_fails_over_or_gives_up_at_once():
    full = Failure(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "busy",
        "OVERLOADED",
        retry_after_ms=400,
        error_metadata={"retry_within_budget": "false"},
        server_time_us=int(NOW_WALL_S * 1e6),
    )
    p, _ = retrier(num_endpoints=1)
    assert attempt(p, p.start(deadline_ms=5_000, model=""), 0, full) == GiveUp("no_room_within_deadline")
    p2, _ = retrier(num_endpoints=2)
    decision = attempt(p2, p2.start(deadline_ms=5_000, model=""), 0, full)
    assert decision == Retry(1, 0.0, "failover")


@pytest.mark.parametrize("within_budget", [True, False])
def test_one_endpoint_that_says_there_is_no_other_is_retried_at_its_hint_or_given_up_on(within_budget):
    """One endpoint: a replica alone (`elsewhere=false`) is never answered by another endpoint; the hint is followed
    when it is invited (`retry_within_budget`), else the call gives up at once. Two: another, as for any refusal."""
    alone = Failure(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "busy",
        "OVERLOADED",
        retry_after_ms=400,
        error_metadata={"retry_within_budget": str(within_budget).lower(), "elsewhere": "false"},
        server_time_us=int(NOW_WALL_S * 1e6),
    )
    p, _ = retrier(num_endpoints=1)
    decision = attempt(p, p.start(deadline_ms=5_000, model=""), 0, alone)
    assert decision == (Retry(0, 0.4, "hint") if within_budget else GiveUp("no_room_within_deadline"))
    p2, _ = retrier(num_endpoints=2)
    assert attempt(p2, p2.start(deadline_ms=5_000, model=""), 0, alone) == Retry(1, 0.0, "failover")


def test_a_resource_exhausted_from_grpc_itself_is_no_overload_and_is_not_retried():
    p, _ = retrier(num_endpoints=2)
    state = p.start(1_000, "")
    too_big = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (5000000 vs. 4194304)")
    assert attempt(p, state, 0, too_big) == GiveUp("not_retryable")
    assert isinstance(attempt(p, state, 0, overloaded(50)), Retry)


# --- quota refusals: the tenant's cap, not a replica's load -----------------------------------------------------


def quota_refusal(hint_ms: int | None, cap: str = "calls_per_s", reason: str = "QUOTA_EXCEEDED", **fields) -> Failure:
    return Failure(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "tenant 'acme' is at its quota",
        reason,
        error_metadata={"cap": cap},
        retry_after_ms=hint_ms,
        server_time_us=int(NOW_WALL_S * 1e6),
        **fields,
    )


def test_a_rate_refusal_waits_its_hint_on_the_same_endpoint_and_never_fails_over():
    p, _ = retrier(num_endpoints=3, rand=0.5)
    state = p.start(deadline_ms=5_000, model="")
    decision = attempt(p, state, 1, quota_refusal(200))
    assert isinstance(decision, Retry) and decision.endpoint == 1 and decision.reason == "quota"
    assert 0.200 <= decision.delay_s <= 0.200 + 0.020
    assert p.board.free_at_s == [0.0, 0.0, 0.0]  # the replicas are not busy for the client's other calls


@pytest.mark.parametrize("hint_ms", [None, -1, 4_990, 10 * 86_400_000])
def test_a_quota_refusal_without_a_hint_that_fits_the_deadline_gives_up_at_once(hint_ms):
    p, _ = retrier(num_endpoints=2)
    state = p.start(deadline_ms=5_000, model="")
    assert attempt(p, state, 0, quota_refusal(hint_ms, cap="device_us_per_month")) == GiveUp("quota")


def test_a_quota_failure_detail_alone_is_a_quota_refusal_and_overload_is_not():
    from services.client.failure import QuotaViolation

    bare = quota_refusal(None, reason="", quota_violations=(QuotaViolation("tenant:acme", "calls_per_s: 5 of 5"),))
    assert bare.is_quota and not overloaded(100).is_quota
    p, _ = retrier(num_endpoints=2)
    assert attempt(p, p.start(deadline_ms=5_000, model=""), 0, bare) == GiveUp("quota")


def test_quota_retries_count_against_the_attempt_limit():
    p, _ = retrier(num_endpoints=1, max_attempts=2)
    state = p.start(deadline_ms=60_000, model="")
    assert isinstance(attempt(p, state, 0, quota_refusal(100)), Retry)
    assert attempt(p, state, 0, quota_refusal(100)) == GiveUp("quota")


def test_the_replicas_quota_status_parses_into_a_quota_failure_with_its_hint():
    from services import errors
    from services.client.failure import parse_failure
    from services.status import status_for, to_grpc_status

    reset_us = 1_800_086_400_000_000
    refusal = errors.QuotaExceeded("acme", "device_us_per_month", 3_600, 3_600, 86_400_000, 2_000, reset_us)
    sent = to_grpc_status(status_for(refusal))
    failure = parse_failure(sent.code, sent.details, sent.trailing_metadata)
    assert failure.is_quota and failure.reason == "QUOTA_EXCEEDED" and failure.retry_after_ms == 86_400_000
    (violation,) = failure.quota_violations
    assert violation.subject == "tenant:acme" and violation.description == "device_us_per_month: 3600 of 3600 used"
    assert failure.error_metadata["cap"] == "device_us_per_month"
    assert dict(sent.trailing_metadata)["grpc-retry-pushback-ms"] == "-1"  # the reset is past the deadline
