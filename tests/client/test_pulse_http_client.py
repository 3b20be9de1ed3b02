"""pulse's HTTP door client (services/pulse/http_client.py) against a fake door (httpx.MockTransport): what it sends,
how it reads an answer, and when it retries, on a clock that only sleeping moves."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import httpx
import pytest

from services.client import (
    DeadlineExceeded,
    DeadlineInfeasible,
    QuotaExceeded,
    Rejected,
    RetryConfig,
    Unauthenticated,
    Unavailable,
)
from services.pulse.http_client import HttpClient, failure_from_response
from services.pulse.http_pools import HttpPools
from services.pulse.runner import run_plan
from services.pulse.schedule import PlannedRequest
from services.pulse.stats import TraceOutcome, summarize

URL = "http://door.test"


class FrozenTime:
    """A monotonic clock that stands still but for sleeps, which it records instead of waiting."""

    def __init__(self, late_s: float = 0.0) -> None:
        self.now_s, self.sleeps, self.late_s = 1000.0, [], late_s  # late_s: every sleep overshoots by this

    def clock(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now_s += seconds + self.late_s


def ok(request: httpx.Request, deadline_met: str = "true") -> httpx.Response:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    usage["device_time"] = {"unit": "core_us", "amount": 4321}
    body = {"id": "cmpl-1", "object": "text_completion", "usage": usage}
    body["choices"] = [{"text": " a b", "index": 0, "finish_reason": "length"}]
    headers = {
        "x-call-id": "call-7",
        "x-request-id": request.headers["x-request-id"],
        "x-budget-ms": request.headers["x-budget-ms"],
        "x-budget-source": "header",
        "x-request-dispatch-time": "250",
        "x-server-time": "1700000000000000",
        "x-deadline-met": deadline_met,
    }
    return httpx.Response(200, json=body, headers=headers)


def refusal(status: int, code: str, hint_ms: int | None = None, should_retry: str | None = None, **metadata):
    headers = {"x-server-time": "1700000000000000"}
    if hint_ms is not None:
        headers |= {"retry-after-ms": str(hint_ms), "retry-after": str(-(-hint_ms // 1000))}
    if should_retry is not None:
        headers["x-should-retry"] = should_retry
    info = {"reason": code, "domain": "zeroqueue", "metadata": {k: str(v) for k, v in metadata.items()}}
    error = {"message": f"no: {code}", "type": "rate_limit_error", "param": None, "code": code, "error_info": info}
    return httpx.Response(status, json={"error": error}, headers=headers)


def call(answers: list, deadline_ms: float = 2_000, retry: RetryConfig | None = None, late_s: float = 0.0, **options):
    """One call through HttpClient against `answers` (each a function of the request, or an exception to raise);
    returns (the requests seen, the result or the error, the generation, the sleeps)."""
    seen, time_ = [], FrozenTime(late_s)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers.pop(0) if answers else ok
        if isinstance(answer, Exception):
            raise answer
        return answer(request) if callable(answer) else answer

    async def main():
        client = HttpClient(
            [URL], "key-1", retry=retry, transport=httpx.MockTransport(handler), clock=time_.clock,
            wall_clock=lambda: 1_700_000_000.0, sleep=time_.sleep, rand=lambda: 0.0,
        )  # fmt: skip
        async with client:
            options.setdefault("temperature", 0.0)
            prompt = options.pop("prompt", [17, 42, 99])
            generation = client.generate(prompt, deadline_ms, max_tokens=2, request_id="r-1", **options)
            try:
                chunks = [chunk async for chunk in generation]
                return chunks, generation.result, generation
            except Exception as error:  # noqa: BLE001 - the test looks at it
                return [], error, generation

    chunks, outcome, generation = asyncio.run(main())
    return seen, outcome, generation, time_.sleeps


def test_success_sends_the_contract_and_reads_the_answer():
    seen, result, generation, sleeps = call([ok], service_class="standard")
    (request,) = seen
    assert request.method == "POST" and str(request.url) == URL + "/v1/completions"
    assert json.loads(request.content) == {"prompt": [17, 42, 99], "max_tokens": 2, "temperature": 0.0, "stream": False}
    headers = request.headers
    assert headers["authorization"] == "Bearer key-1" and headers["x-budget-ms"] == "2000"
    assert headers["x-request-id"] == "r-1" and headers["x-stainless-retry-count"] == "0"
    assert headers["x-service-class"] == "standard"
    assert result.text == " a b" and result.token_ids == () and result.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, 2)
    assert (result.usage.device_us, result.usage.unit) == (4321, "core_us")
    assert result.timings.finished_at_us is None and result.timings.queue_us == 250
    assert result.timings.deadline_met is True and result.timings.total_us is None
    assert result.admission.call_id == "call-7" and result.admission.budget_ms == 2000
    assert result.admission.prompt_tokens == 3 and result.admission.endpoint == URL
    assert [a.outcome for a in result.report.attempts] == ["admitted"] and sleeps == []


def test_text_prompt_model_seed_and_a_missed_deadline():
    seen, result, _, _ = call([lambda r: ok(r, "false")], prompt="def f():", model="m", seed=5, stop=["\n"])
    body = json.loads(seen[0].content)
    assert body["prompt"] == "def f():" and body["model"] == "m" and body["seed"] == 5 and body["stop"] == ["\n"]
    assert "x-service-class" not in seen[0].headers
    assert result.timings.deadline_met is False


def test_a_429_is_retried_after_its_hint_with_the_same_id_and_a_rising_count():
    answers = [refusal(429, "OVERLOADED", 150, cause="slots_full"), refusal(429, "OVERLOADED", 100), ok]
    seen, result, _, sleeps = call(answers)
    assert sleeps == [0.15, 0.1]  # the hint exactly (no jitter at rand 0)
    assert [r.headers["x-request-id"] for r in seen] == ["r-1"] * 3
    assert [r.headers["x-stainless-retry-count"] for r in seen] == ["0", "1", "2"]
    assert [r.headers["x-budget-ms"] for r in seen] == ["2000", "1850", "1750"]  # what the call has left
    assert len({r.content for r in seen}) == 1
    outcomes = [(a.outcome, a.reason, a.retry_after_ms, a.wait_reason) for a in result.report.attempts]
    assert outcomes == [
        ("RESOURCE_EXHAUSTED", "OVERLOADED", 150, ""),
        ("RESOURCE_EXHAUSTED", "OVERLOADED", 100, "hint"),
        ("admitted", "", None, "hint"),
    ]


def test_retry_after_seconds_when_the_exact_hint_is_missing():
    response = refusal(429, "OVERLOADED")
    response.headers["retry-after"] = "2"
    assert failure_from_response(response).retry_after_ms == 2000


def test_x_should_retry_false_is_not_retried():
    answer = refusal(429, "OVERLOADED", 50, "false", cause="step_budget", retry_within_budget="false")
    seen, error, _, sleeps = call([answer])
    assert isinstance(error, Rejected) and len(seen) == 1 and sleeps == []
    assert error.cause == "step_budget" and error.retry_after_ms == 50
    assert error.report.gave_up == "no_room_within_deadline"
    seen, error, _, _ = call([refusal(429, "OVERLOADED", 50, "false")])
    assert isinstance(error, Rejected) and len(seen) == 1 and error.report.gave_up == "not_invited"


def test_an_infeasible_budget_is_not_retried():
    seen, error, _, _ = call([refusal(400, "DEADLINE_INFEASIBLE", should_retry="false", min_budget_ms=900)])
    assert isinstance(error, DeadlineInfeasible) and len(seen) == 1
    assert error.min_budget_ms == 900 and error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert [a.outcome for a in error.report.attempts] == ["DEADLINE_EXCEEDED"]


def test_a_retry_that_would_not_fit_the_budget_is_not_sent():
    seen, error, _, sleeps = call([refusal(429, "OVERLOADED", 600)], deadline_ms=500)
    assert isinstance(error, Rejected) and len(seen) == 1 and sleeps == []
    assert error.report.gave_up == "deadline"
    # 480 ms hint leaves 20 ms: under the 25 ms an attempt needs (RetryConfig.min_attempt_budget_ms)
    seen, error, _, _ = call([refusal(429, "OVERLOADED", 480)], deadline_ms=500)
    assert isinstance(error, Rejected) and len(seen) == 1


def test_a_retry_woken_past_the_deadline_is_not_sent():
    """The retry fitted when it was planned, but its sleep ran late (a busy event loop): no budget left."""
    seen, error, _, sleeps = call([refusal(429, "OVERLOADED", 100)], deadline_ms=500, late_s=0.5)
    assert isinstance(error, Rejected) and len(seen) == 1 and sleeps == [0.1]
    assert [a.outcome for a in error.report.attempts] == ["RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"]


def test_max_attempts_counts_as_the_sdk_does():
    answers = [refusal(429, "OVERLOADED", 10)] * 5
    seen, error, _, _ = call(answers, retry=RetryConfig(max_attempts=3))
    assert isinstance(error, Rejected) and len(seen) == 3 and error.report.gave_up == "max_attempts"


def test_a_budget_spent_before_arrival_is_a_deadline_exceeded():
    seen, error, _, _ = call([refusal(408, "DEADLINE_EXPIRED", should_retry="false")])
    assert isinstance(error, DeadlineExceeded) and len(seen) == 1 and not error.failure.after_admission


def test_a_deadline_missed_while_running_ends_the_call():
    seen, error, _, _ = call([refusal(504, "DEADLINE_MISSED")])
    assert isinstance(error, DeadlineExceeded) and not isinstance(error, DeadlineInfeasible)
    assert len(seen) == 1 and error.failure.after_admission and error.report.gave_up == "after_admission"


def test_quota_unavailable_and_bad_key():
    seen, error, _, _ = call([refusal(429, "QUOTA_EXCEEDED", 10_000, cap="calls_per_s")])
    assert isinstance(error, QuotaExceeded) and error.cap == "calls_per_s" and len(seen) == 1
    seen, result, _, sleeps = call([refusal(503, "NOT_SERVING", 1000), ok])
    assert result.text == " a b" and len(seen) == 2 and len(sleeps) == 1
    seen, error, _, _ = call([httpx.ConnectError("refused"), ok])
    assert not isinstance(error, Exception) and len(seen) == 2
    seen, error, _, _ = call([httpx.ConnectError("refused")] * 10, deadline_ms=100)
    assert isinstance(error, Unavailable) and error.reason == "UNREACHABLE"
    seen, error, _, _ = call([refusal(401, "UNAUTHENTICATED")])
    assert isinstance(error, Unauthenticated) and len(seen) == 1


def test_an_overload_then_no_budget_reads_as_the_rejection():
    """As the SDK over gRPC: infeasible only because refusals ate the budget is a rejection."""
    answers = [refusal(429, "OVERLOADED", 100), refusal(400, "DEADLINE_INFEASIBLE", should_retry="false")]
    seen, error, _, _ = call(answers)
    assert isinstance(error, Rejected) and len(seen) == 2


def test_what_the_door_does_not_take_is_refused_before_sending():
    client_args = dict(transport=httpx.MockTransport(ok))

    async def main():
        async with HttpClient([URL], "k", **client_args) as client:
            for option in ({"messages": [{"role": "user", "content": "hi"}]}, {"logprobs": True}):
                with pytest.raises(ValueError, match="takes no"):
                    client.generate(None if "messages" in option else [1], 100, **option)
            with pytest.raises(TypeError, match="deadline_ms"):
                client.generate([1])

    asyncio.run(main())


def test_the_runner_records_http_calls_as_it_records_grpc_ones():
    answers = [refusal(429, "OVERLOADED", 20), ok, refusal(400, "DEADLINE_INFEASIBLE", should_retry="false")]

    def handler(request: httpx.Request) -> httpx.Response:
        answer = answers.pop(0) if answers else ok
        return answer(request) if callable(answer) else answer

    requests = [PlannedRequest(i, 0.1 * i, (20, 21, 22), 2, 2_000.0) for i in range(4)]  # the retry before #1

    async def main():
        async with HttpClient([URL], "k", transport=httpx.MockTransport(handler), rand=lambda: 0.0) as client:
            return await run_plan(client, requests, "p")

    traces = asyncio.run(main())
    outcomes = sorted(t.outcome for t in traces)
    assert outcomes == sorted([TraceOutcome.OK] * 3 + [TraceOutcome.INFEASIBLE])
    refused = next(t for t in traces if len(t.attempts) == 2)
    assert [o for _, o in refused.attempts] == ["RESOURCE_EXHAUSTED", "admitted"] and refused.endpoint == URL
    done = [t for t in traces if t.outcome == TraceOutcome.OK]
    assert all(t.device_us == 4321 and t.server_queue_us == 250 and t.server_total_us is None for t in done)
    assert all(t.final_lag_us is None for t in done)
    assert all(t.first_token_s is None and t.completion_tokens == 2 for t in done)
    summary = summarize(traces, 1.0)
    assert summary.rejection_rate == 0.25 and summary.first_retry_success_rate == 1.0
    assert summary.num_in_deadline == 3 and summary.server_latency_ms.count == 0


def test_the_pools_hold_the_calls_in_flight_a_few_connections_each():
    async def main():
        pools = HttpPools(37, pool_connections=16)
        with contextlib.ExitStack() as stack:
            leased = [stack.enter_context(pools.lease()) for _ in range(50)]
            counts = list(pools.in_flight)
        limits = [c._transport._pool._max_connections for c in pools.clients]
        keepalive = [c._transport._pool._max_keepalive_connections for c in pools.clients]
        await pools.aclose()
        return leased, counts, limits, keepalive, list(pools.in_flight)

    leased, counts, limits, keepalive, after = asyncio.run(main())
    assert len(set(map(id, leased))) == 3 and limits == keepalive == [16, 16, 16]  # ceil(37 / 16) pools, no more
    assert counts == [17, 17, 16] and after == [0, 0, 0]  # each filled in turn; past the cap, the least busy


def test_one_pool_is_never_bigger_than_the_cap():
    pools = HttpPools(5, pool_connections=16)
    assert (pools.pool_size, pools.max_pools) == (5, 1)
