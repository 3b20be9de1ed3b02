"""The SDK's retries against fake replicas with scripted answers, through both the sync and asyncio clients.

Sleeping goes through a virtual clock: the test sees the exact delay the client asked for, without waiting
it and without asserting any wall-clock time.
"""

from __future__ import annotations

import subprocess

import grpc
import pytest

from services import errors
from services.client import (
    Client,
    DeadlineExceeded,
    DeadlineInfeasible,
    InvalidRequest,
    PermissionDenied,
    QuotaExceeded,
    Rejected,
    RequestIdInUse,
    RetryConfig,
    Unauthenticated,
    Unavailable,
)
from tests.client.fakes import Fail, FakeReplicas, Refuse, Reject, Serve, VirtualTime, run_call

DEFAULT = RetryConfig()


@pytest.fixture(params=["sync", "async"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def vt() -> VirtualTime:
    return VirtualTime()


def test_success_streams_chunks_then_a_result_with_usage_and_timings(kind, vt):
    with FakeReplicas([[Serve(num_chunks=3)]]) as fakes:
        out = run_call(kind, fakes.addresses, vt, request_id="req-7", labels={"team": "search"})
    assert [c.text for c in out.chunks] == ["t0", "t1", "t2"]
    assert out.result.text == "t0t1t2" and out.result.token_ids == (10, 11, 12)
    assert out.result.usage.device_us == 1234 and out.result.usage.completion_tokens == 3
    assert out.result.timings.deadline_met and out.result.finish_reason == "length"
    assert out.result.request_id == "req-7" and out.result.admission.endpoint == fakes.addresses[0]
    assert out.report.num_attempts == 1 and out.report.waited_s == 0 and vt.sleeps == []
    (seen,) = fakes[0].calls
    assert seen.metadata["authorization"] == "Bearer key-1"
    assert seen.retry_attempt is None and seen.request.labels["team"] == "search"


@pytest.mark.parametrize("rand_value", [0.0, 0.5, 0.999])
def test_waits_the_hint_plus_at_most_the_jitter_and_retries_with_the_same_request_id(kind, vt, rand_value):
    with FakeReplicas([[Reject(300), Reject(120), Serve()]]) as fakes:
        out = run_call(kind, fakes.addresses, vt, rand=lambda: rand_value)
    assert out.error is None and out.result is not None
    first, second = vt.sleeps
    assert 0.300 <= first <= 0.300 + min(DEFAULT.max_jitter_ms, 0.1 * 300) / 1000
    assert 0.120 <= second <= 0.120 + min(DEFAULT.max_jitter_ms, 0.1 * 120) / 1000
    assert first == pytest.approx(0.300 + rand_value * 0.020) and second == pytest.approx(0.120 + rand_value * 0.012)
    calls = fakes[0].calls
    assert [c.retry_attempt for c in calls] == [None, "1", "2"]
    assert len({c.request.request_id for c in calls}) == 1 and calls[0].request.request_id
    assert out.result.request_id == calls[0].request.request_id
    assert out.report.num_attempts == 3 and out.report.num_rejections == 2
    assert out.report.waited_s == pytest.approx(first + second)
    assert [a.wait_reason for a in out.report.attempts] == ["", "hint", "hint"]
    assert [a.retry_after_ms for a in out.report.attempts] == [300, 120, None]


def test_a_real_sleep_reaches_the_server_no_earlier_than_the_hint():
    with FakeReplicas([[Reject(150), Serve()]]) as fakes:
        with Client(fakes.addresses, api_key="k") as client:
            client.complete("x", deadline_ms=3_000, max_tokens=2)
    first, second = fakes[0].calls
    assert second.at_s - first.at_s >= 0.150


def test_gives_up_at_once_when_the_hint_would_pass_the_deadline(kind, vt):
    with FakeReplicas([[Reject(5_000)]]) as fakes:
        out = run_call(kind, fakes.addresses, vt, deadline_ms=1_000)
    assert isinstance(out.error, Rejected) and out.error.retry_after_ms == 5_000
    assert vt.sleeps == [] and len(fakes[0].calls) == 1
    assert out.report.gave_up == "deadline" and out.report.num_attempts == 1


def test_each_attempt_carries_the_remaining_budget_and_the_last_wait_ends_inside_the_deadline(kind, vt):
    with FakeReplicas([[Reject(300)] * 10]) as fakes:
        out = run_call(kind, fakes.addresses, vt, deadline_ms=1_000, rand=lambda: 0.0)
    assert isinstance(out.error, Rejected) and out.report.gave_up == "deadline"
    attempts = out.report.attempts
    assert len(attempts) == 4  # at about 0, 0.3, 0.6 and 0.9 s; a fifth would start at 1.2 s
    for attempt, seen in zip(attempts, fakes[0].calls, strict=True):
        assert attempt.timeout_s == pytest.approx(1.0 - attempt.started_s, abs=0.01)
        # gRPC rounds the grpc-timeout header up to a few significant digits: up to about 1 % more
        assert seen.time_remaining_s <= attempt.timeout_s * 1.01 + 0.005
    assert [a.timeout_s for a in attempts] == sorted((a.timeout_s for a in attempts), reverse=True)
    assert sum(vt.sleeps) < 1.0


def test_a_retry_whose_shrunken_budget_is_infeasible_reports_the_overload(kind, vt):
    infeasible = Fail(grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_INFEASIBLE", {"min_budget_ms": "300"})
    with FakeReplicas([[Reject(700), infeasible]]) as fakes:
        out = run_call(kind, fakes.addresses, vt, deadline_ms=1_000, rand=lambda: 0.0)
    assert type(out.error) is Rejected and out.error.retry_after_ms == 700
    assert out.report.gave_up == "deadline" and len(fakes[0].calls) == 2
    assert [(a.outcome, a.reason) for a in out.report.attempts] == [
        ("RESOURCE_EXHAUSTED", "OVERLOADED"),
        ("DEADLINE_EXCEEDED", "DEADLINE_INFEASIBLE"),
    ]


@pytest.mark.parametrize("skew_s", [10.0, -10.0])
def test_a_skewed_server_clock_means_backoff_instead_of_the_hint(kind, vt, skew_s):
    with FakeReplicas([[Reject(400, skew_s=skew_s), Serve()]]) as fakes:
        out = run_call(kind, fakes.addresses, vt, rand=lambda: 0.5)
    assert out.result is not None
    assert vt.sleeps == [pytest.approx(0.5 * DEFAULT.backoff_base_ms / 1000)]  # full jitter over the first cap
    assert out.report.attempts[1].wait_reason == "clock_skew"


def test_a_small_skew_keeps_the_hint(kind, vt):
    with FakeReplicas([[Reject(400, skew_s=1.0), Serve()]]) as fakes:
        out = run_call(kind, fakes.addresses, vt, rand=lambda: 0.0)
    assert vt.sleeps == [pytest.approx(0.4)] and out.report.attempts[1].wait_reason == "hint"


def test_a_rejection_fails_over_to_another_endpoint_at_once(kind, vt):
    with FakeReplicas([[Reject(400)], [Serve()]]) as fakes:
        out = run_call(kind, fakes.addresses, vt)
    assert out.result is not None and vt.sleeps == []
    assert [a.endpoint for a in out.report.attempts] == fakes.addresses
    assert out.report.attempts[1].wait_reason == "failover"
    assert fakes[1].calls[0].retry_attempt == "1"
    assert fakes[1].calls[0].request.request_id == fakes[0].calls[0].request.request_id


def test_a_busy_endpoint_is_skipped_until_its_hint_passes(kind, vt):
    # A: busy for 400 ms. B: busy for 100 ms, then for 500 ms. The call must go A, B, (wait) B, (wait) A,
    # and its last try on A must not start before A's 400 ms have passed.
    with FakeReplicas([[Reject(400), Serve()], [Reject(100), Reject(500)]]) as fakes:
        out = run_call(kind, fakes.addresses, vt, rand=lambda: 0.0)
    a, b = fakes.addresses
    assert out.result is not None
    assert [x.endpoint for x in out.report.attempts] == [a, b, b, a]
    assert [x.wait_reason for x in out.report.attempts] == ["", "failover", "hint", "hint"]
    assert vt.sleeps[0] == pytest.approx(0.1, abs=0.02)
    assert out.report.attempts[3].started_s >= 0.4
    assert [c.retry_attempt for c in fakes.all_calls] == [None, "1", "2", "3"]
    assert len({c.request.request_id for c in fakes.all_calls}) == 1


def test_unavailable_fails_over_to_another_endpoint(kind, vt):
    with FakeReplicas([[Fail(grpc.StatusCode.UNAVAILABLE, "NOT_SERVING")], [Serve()]]) as fakes:
        out = run_call(kind, fakes.addresses, vt)
    assert out.result is not None and vt.sleeps == []
    assert [a.outcome for a in out.report.attempts] == ["UNAVAILABLE", "admitted"]


def test_an_unreachable_endpoint_fails_over(kind, vt):
    with FakeReplicas([[Serve()]]) as fakes:
        import socket

        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        out = run_call(kind, [dead, *fakes.addresses], vt)
    assert out.result is not None
    assert [a.endpoint for a in out.report.attempts] == [dead, fakes.addresses[0]]


def test_unavailable_everywhere_switches_to_the_fallback_model(kind, vt):
    with FakeReplicas([[Fail(grpc.StatusCode.UNAVAILABLE, "NOT_SERVING"), Serve()]]) as fakes:
        out = run_call(kind, fakes.addresses, vt, retry=RetryConfig(fallback_model="small"), model="big")
    assert out.result is not None and vt.sleeps == []
    assert [c.request.model for c in fakes[0].calls] == ["big", "small"]
    assert out.report.attempts[1].wait_reason == "fallback_model"


def test_unavailable_without_a_fallback_backs_off_and_gives_up_at_the_attempt_limit(kind, vt):
    with FakeReplicas([[Fail(grpc.StatusCode.UNAVAILABLE)] * 5]) as fakes:
        out = run_call(kind, fakes.addresses, vt, retry=RetryConfig(max_attempts=3), rand=lambda: 1.0)
    assert isinstance(out.error, Unavailable) and out.report.gave_up == "max_attempts"
    assert len(fakes[0].calls) == 3
    assert vt.sleeps == [pytest.approx(0.025), pytest.approx(0.050)]  # equal jitter at its top, doubling


NON_RETRYABLE = [
    (Fail(grpc.StatusCode.INVALID_ARGUMENT, violations=(("temperature", "must be >= 0"),)), InvalidRequest),
    (Fail(grpc.StatusCode.OUT_OF_RANGE, violations=(("max_tokens", "exceeds the context"),)), InvalidRequest),
    (Fail(grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_INFEASIBLE", {"min_budget_ms": "750"}), DeadlineInfeasible),
    (Fail(grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXPIRED"), DeadlineExceeded),
    (Fail(grpc.StatusCode.UNAUTHENTICATED), Unauthenticated),
    (Fail(grpc.StatusCode.PERMISSION_DENIED), PermissionDenied),
    (Fail(grpc.StatusCode.ALREADY_EXISTS, "REQUEST_ID_IN_USE"), RequestIdInUse),
]


@pytest.mark.parametrize(
    "answer,error_type",
    NON_RETRYABLE,
    ids=lambda x: (
        getattr(x, "reason", "") or getattr(getattr(x, "code", None), "name", None) or getattr(x, "__name__", "")
    ),
)
def test_non_retryable_codes_are_raised_after_one_attempt(kind, vt, answer, error_type):
    with FakeReplicas([[answer], [Serve()]]) as fakes:
        out = run_call(kind, fakes.addresses, vt)
    assert type(out.error) is error_type and out.error.code == answer.code
    assert len(fakes.all_calls) == 1 and vt.sleeps == [] and out.report.gave_up == "not_retryable"
    if answer.violations:
        assert [(v.field, v.description) for v in out.error.violations] == list(answer.violations)
    if error_type is DeadlineInfeasible:
        assert out.error.min_budget_ms == 750


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_no_retry_once_tokens_were_delivered(kind, vt, code):
    with FakeReplicas([[Serve(num_chunks=2, then_fail=code)], [Serve()]]) as fakes:
        out = run_call(kind, fakes.addresses, vt)
    assert [c.text for c in out.chunks] == ["t0", "t1"]
    assert out.error is not None and out.error.code == code
    assert out.error.failure.after_admission and out.error.failure.num_tokens_delivered == 2
    assert len(fakes.all_calls) == 1 and out.report.gave_up == "after_admission"


def test_a_caller_that_stops_early_cancels_the_call(vt):
    with FakeReplicas([[Serve(num_chunks=3)]]) as fakes:
        with Client(fakes.addresses, api_key="k") as client:
            generation = client.generate("x", deadline_ms=2_000)
            next(generation)
            generation.close()
            assert generation.result is None and generation.report.num_attempts == 1


def test_bad_deadlines_are_refused_before_any_call():
    with Client(["127.0.0.1:1"], api_key="k") as client:
        for bad in (0, -5, float("nan")):
            with pytest.raises(ValueError, match="deadline_ms"):
                client.generate("x", deadline_ms=bad)


def test_tls_with_the_replica_certificate_and_no_plaintext_fallback(tmp_path, vt):
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(tmp_path / "key.pem"),
            "-out",
            str(tmp_path / "cert.pem"),
        ],
        check=True,
        capture_output=True,
    )
    cert, key = (tmp_path / "cert.pem").read_bytes(), (tmp_path / "key.pem").read_bytes()
    with FakeReplicas([[Serve()]], grpc.ssl_server_credentials([(key, cert)])) as fakes:
        with Client(fakes.addresses, api_key="k", tls=grpc.ssl_channel_credentials(cert)) as client:
            assert client.complete("x", deadline_ms=5_000).text == "t0t1"
        with Client(
            fakes.addresses, api_key="k", retry=RetryConfig(max_attempts=2), clock=vt.clock, sleep=vt.sleep
        ) as plaintext:
            with pytest.raises(Unavailable):
                plaintext.complete("x", deadline_ms=5_000)
    assert len(fakes[0].calls) == 1


@pytest.mark.parametrize("cap", ["device_us_per_month", "spend_micros_per_month", "calls_per_s"])
def test_a_quota_refusal_is_raised_as_quota_exceeded_and_no_other_replica_is_tried(kind, vt, cap):
    meta = {"cap": cap, "limit": "3600", "used": "3600", "resets_at_us": "1800000000000000"}
    with FakeReplicas([[Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED", meta)], [Serve()]]) as fakes:
        out = run_call(kind, fakes.addresses, vt)
    assert type(out.error) is QuotaExceeded and not isinstance(out.error, Rejected)
    assert out.error.cap == cap and out.error.limit == out.error.used == 3600
    assert out.error.resets_at_us == 1_800_000_000_000_000
    assert len(fakes.all_calls) == 1 and vt.sleeps == [] and out.report.gave_up == "quota"


def test_the_call_names_its_class_of_service_on_every_attempt(kind, vt):
    with FakeReplicas([[Reject(50), Serve()]]) as fakes:
        out = run_call(kind, fakes.addresses, vt, service_class="interactive")
    assert out.error is None
    assert [c.request.service_class for c in fakes[0].calls] == ["interactive", "interactive"]
    with FakeReplicas([[Serve()]]) as fakes:
        run_call(kind, fakes.addresses, vt)
    assert fakes[0].calls[0].request.service_class == ""  # none named: the replica picks by the deadline


# --- is there an elsewhere? (issue 35): a replica alone, or a saturated one with others beside it ----------------


def test_with_one_endpoint_a_replica_alone_is_retried_at_its_hint(kind, vt):
    backed = errors.Overloaded(300, 120, 2_000, cause="slots_full", reserved=True, elsewhere=False)
    with FakeReplicas([[Refuse(backed), Serve()]]) as fakes:
        out = run_call(kind, fakes.addresses, vt, rand=lambda: 0.0)
    assert out.result is not None and vt.sleeps == [pytest.approx(0.3)] and len(fakes[0].calls) == 2
    assert [a.wait_reason for a in out.report.attempts] == ["", "hint"]
    assert out.report.attempts[0].retry_after_ms == 300


def test_with_one_endpoint_a_replica_alone_that_invites_no_retry_is_given_up_on_at_once(kind, vt):
    full = errors.Overloaded(300, 120, 2_000, cause="slots_full", saturated=True, elsewhere=False)
    with FakeReplicas([[Refuse(full), Serve()]]) as fakes:
        out = run_call(kind, fakes.addresses, vt)
    assert isinstance(out.error, Rejected) and out.error.retry_after_ms == 300
    assert vt.sleeps == [] and len(fakes[0].calls) == 1 and out.report.gave_up == "no_room_within_deadline"
    assert out.error.failure.error_metadata["elsewhere"] == "false"
    assert "there is no other replica to try" in out.error.failure.message


def test_with_two_endpoints_a_saturated_replica_with_others_is_left_for_the_other_at_once(kind, vt):
    saturated = errors.Overloaded(300, 120, 2_000, cause="slots_full", saturated=True, elsewhere=True)
    with FakeReplicas([[Refuse(saturated)], [Serve()]]) as fakes:
        out = run_call(kind, fakes.addresses, vt)
    assert out.result is not None and vt.sleeps == []
    assert [a.endpoint for a in out.report.attempts] == fakes.addresses
    assert out.report.attempts[1].wait_reason == "failover"
