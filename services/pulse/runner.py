"""Open-loop load: every planned request is sent at its planned time, whatever the server is doing.

One asyncio task per request (no pool that a slow server could exhaust and so slow the arrivals down);
each goes through the SDK, so refusals are retried as a real client would retry them. The client is the SDK's
AsyncClient (the gRPC door) or http_client.HttpClient (the HTTP door): the same calls, results and errors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from services.client import (
    AsyncClient,
    DeadlineExceeded,
    DeadlineInfeasible,
    QuotaExceeded,
    Rejected,
    Unavailable,
    ZeroQueueError,
)

from .schedule import PlannedRequest
from .stats import RequestTrace, TraceOutcome

OUTCOMES = (
    (Rejected, TraceOutcome.REJECTED),
    (QuotaExceeded, TraceOutcome.QUOTA),
    (DeadlineInfeasible, TraceOutcome.INFEASIBLE),
    (DeadlineExceeded, TraceOutcome.DEADLINE_EXCEEDED),
    (Unavailable, TraceOutcome.UNAVAILABLE),
)


def outcome_of(error: ZeroQueueError) -> TraceOutcome:
    return next((name for cls, name in OUTCOMES if isinstance(error, cls)), TraceOutcome.ERROR)


def _generate(client: AsyncClient, request: PlannedRequest, request_id: str):
    """A plain call on the planned token ids, greedy; or what its template sends."""
    call = {"prompt": request.prompt_token_ids, "temperature": 0.0}
    if request.template is not None:
        call = request.template.call(request.prompt_token_ids)
    return client.generate(
        **call,
        deadline_ms=request.deadline_ms,
        max_tokens=request.max_tokens,
        request_id=request_id,
        service_class=request.service_class,
    )


def trace_of(request: PlannedRequest, planned_s: float | None = None) -> RequestTrace:
    """A request's trace before it is sent. Its prompt tokens are the planned ids' count until the replica counts
    them (its admission): a text prompt's and a conversation's are known only then."""
    return RequestTrace(
        request.index,
        request.at_s if planned_s is None else planned_s,
        request.deadline_ms,
        len(request.prompt_token_ids),
        request.max_tokens,
        kind=request.kind,
    )


async def _one(
    client: AsyncClient,
    request: PlannedRequest,
    trace: RequestTrace,
    t0: float,
    request_id: str,
    on_done: Callable[[RequestTrace], None],
) -> None:
    trace.sent_s = time.monotonic() - t0
    generation = _generate(client, request, request_id)
    try:
        async for chunk in generation:
            if trace.first_token_s is None and chunk.token_ids:
                trace.first_token_s = time.monotonic() - t0
        trace.finished_s = time.monotonic() - t0
        result = generation.result
        finished_at_us = result.timings.finished_at_us  # None: the door did not say (http_client.py)
        trace.final_lag_us = None if finished_at_us is None else time.time_ns() // 1000 - finished_at_us
        trace.outcome, trace.completion_tokens = TraceOutcome.OK, result.usage.completion_tokens
        trace.device_us = result.usage.device_us
        trace.server_deadline_met, trace.server_queue_us = result.timings.deadline_met, result.timings.queue_us
        trace.server_total_us = result.timings.total_us
        trace.prompt_tokens, trace.compile_us = result.admission.prompt_tokens, result.admission.compile_us
        trace.finish_reason = result.finish_reason
        report = result.report
    except ZeroQueueError as error:
        trace.finished_s = time.monotonic() - t0
        trace.outcome, trace.error, report = outcome_of(error), f"{error.code.name}/{error.reason}", error.report
        trace.retry_after_ms = error.failure.retry_after_ms
        quota = isinstance(error, QuotaExceeded)
        trace.refusal_cause = error.failure.error_metadata.get("cause", "quota" if quota else "")
    except Exception as error:  # noqa: BLE001 - a load generator records a client-side failure and goes on
        trace.finished_s = time.monotonic() - t0
        trace.outcome = TraceOutcome.ERROR
        trace.error, report = f"client:{type(error).__name__}: {error}", generation.report
    if report is not None:
        start = trace.sent_s
        trace.attempts = [(start + a.started_s, a.outcome) for a in report.attempts]
        trace.attempt_endpoints = [a.endpoint for a in report.attempts]
        trace.endpoint = report.endpoint
    on_done(trace)


async def run_plan(
    client: AsyncClient,
    requests: Sequence[PlannedRequest],
    id_prefix: str,
    on_sent: Callable[[RequestTrace], None] = lambda t: None,
    on_done: Callable[[RequestTrace], None] = lambda t: None,
    max_in_flight: int = 10_000,
) -> list[RequestTrace]:
    """Sends `requests` at their `at_s` (seconds from now); returns one trace per request. A request that
    would exceed `max_in_flight` calls open at once is recorded as not_sent, never delayed."""
    traces = [trace_of(r) for r in requests]
    in_flight: set[asyncio.Task] = set()
    t0 = time.monotonic()
    for request, trace in zip(requests, traces, strict=True):
        delay_s = t0 + request.at_s - time.monotonic()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if len(in_flight) >= max_in_flight:
            trace.outcome = TraceOutcome.NOT_SENT
            on_done(trace)
            continue
        task = asyncio.create_task(_one(client, request, trace, t0, f"{id_prefix}-{request.index}", on_done))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        on_sent(trace)
    if in_flight:
        await asyncio.wait(in_flight)
    return traces


async def run_closed_loop(
    client: AsyncClient,
    make_request: Callable[[int], PlannedRequest],
    concurrency: int,
    duration_s: float,
    id_prefix: str,
) -> list[RequestTrace]:
    """`concurrency` callers, each sending its next request as soon as the previous one ends: keeps the
    replica saturated, which is how its capacity is measured. A caller whose call was refused waits out the
    refusal's hint first, as a client would: callers that resent at once would spend the replica's CPU on
    refusals (on the Zen 3 host ~200 a second, which slowed the steps they were waiting for)."""
    traces: list[RequestTrace] = []
    t0 = time.monotonic()
    counter = iter(range(10**9))

    async def caller() -> None:
        while time.monotonic() - t0 < duration_s:
            request = make_request(next(counter))
            trace = trace_of(request, time.monotonic() - t0)
            traces.append(trace)
            await _one(client, request, trace, t0, f"{id_prefix}-{request.index}", lambda t: None)
            if trace.outcome == TraceOutcome.REJECTED and trace.retry_after_ms:
                await asyncio.sleep(min(trace.retry_after_ms / 1000, max(duration_s - (time.monotonic() - t0), 0)))
            elif trace.outcome not in (TraceOutcome.OK, TraceOutcome.REJECTED):
                await asyncio.sleep(0.01)  # a failing replica must not turn this into a hot loop

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return traces
