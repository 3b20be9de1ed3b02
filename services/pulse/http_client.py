"""Generate calls through a replica's HTTP door (OpenAI's POST /v1/completions, stream false), with the gRPC SDK's
interface, retries and results, so pulse's runner, stats and report treat both doors alike.

    async with HttpClient(["http://127.0.0.1:8080"], api_key=key, max_connections=64) as client:
        generation = client.generate([17, 42, 99], deadline_ms=2_000, max_tokens=32, temperature=0.0)
        async for chunk in generation:  # one chunk, the whole text: the door answers whole
            ...
        print(generation.result.usage, generation.report.num_attempts)

Every attempt goes through the SDK's CallDriver and Retrier (services/client): the same X-Request-Id on every try,
X-Stainless-Retry-Count 0, 1, ..., X-Budget-Ms the budget the call has left, a 429 retried after its retry-after-ms
when that still fits the budget, no retry where the door says x-should-retry: false. An HTTP answer becomes the
gRPC status the same refusal has there (429 RESOURCE_EXHAUSTED, 400 DEADLINE_INFEASIBLE DEADLINE_EXCEEDED, 504
DEADLINE_MISSED DEADLINE_EXCEEDED after admission, 503 UNAVAILABLE, 401 UNAUTHENTICATED, ...), so the caller gets the
SDK's exceptions (Rejected, DeadlineInfeasible, ...) and attempt records.

What the door does not say is None in the Result: token ids, TTFT, the first step's time, the compile time and the
device's kind. The replica's receipt and finish come from x-received-at-us and x-finished-at-us (its total time is
their difference); its x-request-dispatch-time (receipt -> dispatch) stands for the queue time.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType

import grpc
import httpx

from services.client.aio import AsyncGeneration
from services.client.call import Attempt, CallDriver
from services.client.errors import ZeroQueueError, error_for
from services.client.failure import Failure
from services.client.request import build_request
from services.client.results import Admission, Chunk, Result, Timings, Usage
from services.client.retry import Retrier, RetryConfig

from .http_pools import HttpPools

COMPLETIONS_PATH = "/v1/completions"
GRACE_S = 1.0  # an attempt waits this long past its budget for the door's own 504 before giving up on it itself
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.INVALID_ARGUMENT,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,  # DEADLINE_EXPIRED: the budget was spent before the call arrived
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    431: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def _int(value: object) -> int | None:
    """An integer header or field; a fraction rounds up (a retry hint is never cut short); None if absent or not
    a number."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit()):
        return int(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return math.ceil(number) if math.isfinite(number) else None


def _error_body(response: httpx.Response) -> dict:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


def _retry_after_ms(response: httpx.Response, metadata: Mapping[str, str]) -> int | None:
    """retry-after-ms (exact), else the body's, else Retry-After (whole seconds)."""
    for value in (response.headers.get("retry-after-ms"), metadata.get("retry_after_ms")):
        if _int(value) is not None:
            return _int(value)
    seconds = _int(response.headers.get("retry-after"))
    return None if seconds is None else seconds * 1000


def failure_from_response(response: httpx.Response) -> Failure:
    """An HTTP refusal as the Failure the same refusal is over gRPC."""
    error = _error_body(response)
    info = error.get("error_info") if isinstance(error.get("error_info"), dict) else {}
    raw = info.get("metadata") if isinstance(info.get("metadata"), dict) else {}
    metadata = {str(k): str(v) for k, v in raw.items()}
    reason = str(error.get("code") or info.get("reason") or "")
    code = _CODES.get(response.status_code, grpc.StatusCode.UNKNOWN)
    if response.status_code == 429 and not reason:
        reason = "OVERLOADED"  # a bare 429 (a proxy's, say) is a refusal for load
    if reason in ("DEADLINE_INFEASIBLE", "DEADLINE_MISSED"):
        code = grpc.StatusCode.DEADLINE_EXCEEDED
    message = str(error.get("message") or (response.text[:200] if not error else ""))
    return Failure(
        code=code,
        message=message or f"HTTP {response.status_code}",
        reason=reason,
        error_metadata=MappingProxyType(metadata),
        retry_after_ms=_retry_after_ms(response, metadata),
        server_time_us=_int(response.headers.get("x-server-time")),
        after_admission=reason == "DEADLINE_MISSED",  # the door admitted it, then ran out of time
    )


def _transport_failure(error: Exception) -> Failure:
    """No answer: unreachable (retried as gRPC's UNAVAILABLE is) or out of time (DEADLINE_EXCEEDED)."""
    if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout):
        return Failure(grpc.StatusCode.UNAVAILABLE, f"{type(error).__name__}: {error}", reason="UNREACHABLE")
    if isinstance(error, TimeoutError | httpx.TimeoutException):
        return Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer inside the budget", reason="CLIENT_TIMEOUT")
    return Failure(grpc.StatusCode.UNAVAILABLE, f"{type(error).__name__}: {error}", reason="CONNECTION_LOST")


class HttpCallDriver(CallDriver):
    """The SDK's CallDriver, told how an HTTP attempt ended."""

    def failed(self, attempt: Attempt, failure: Failure, should_retry: bool = True) -> ZeroQueueError | None:
        """As CallDriver.failed; `should_retry` False (x-should-retry: false): no further attempt, whatever the
        retrier would do (it still learns that the endpoint is busy)."""
        error = super().failed(attempt, failure)
        if error is not None or should_retry:
            return error
        no_room = failure.error_metadata.get("retry_within_budget") == "false"
        self.gave_up = "no_room_within_deadline" if no_room else "not_invited"
        return error_for(self._told(failure), self.report())

    def answered(self, attempt: Attempt, response: httpx.Response) -> Result:
        """A 200: the attempt admitted, and the call's Result."""
        self._settle("admitted")
        self.retrier.on_admitted(attempt.endpoint)
        try:
            return self._result(attempt, response)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
            raise self.protocol_error(f"a 200 whose body is no completion ({error})") from error

    def _result(self, attempt: Attempt, response: httpx.Response) -> Result:
        body, headers = response.json(), response.headers
        choice, usage = body["choices"][0], body["usage"]
        device = usage.get("device_time") or {}
        met = headers.get("x-deadline-met")
        received_us, finished_us = _int(headers.get("x-received-at-us")), _int(headers.get("x-finished-at-us"))
        self.admission = Admission(
            headers.get("x-request-id") or self.request_id,
            self.endpoints[attempt.endpoint],
            received_us,
            None,  # dispatched_at_us
            None,  # predicted_finish_at_us
            None,  # deadline_at_us
            _int(headers.get("x-budget-ms")),
            int(usage["prompt_tokens"]),
            headers.get("x-call-id") or str(body.get("id") or ""),
            headers.get("x-service-class", ""),
            None,  # predicted_start_at_us
            None,  # compile_us
        )
        timings = Timings(
            received_us,
            None,
            None,
            finished_us,
            _int(headers.get("x-request-dispatch-time")),  # receipt -> dispatch
            None,
            None if received_us is None or finished_us is None else finished_us - received_us,
            None if met is None else met.lower() == "true",
        )
        used = Usage(
            int(usage["prompt_tokens"]),
            int(usage["completion_tokens"]),
            _int(device.get("amount")),
            str(device.get("unit", "")),
            "",
            "",
            0,
        )
        text = str(choice.get("text") or "")
        finish = str(choice.get("finish_reason") or "")
        return Result(self.request_id, text, (), finish, used, timings, self.admission, self.report())


class HttpGeneration(AsyncGeneration):
    """As AsyncGeneration (its chunks, `result`, `report`, `admission`), over the HTTP door: one chunk, the whole
    text, since the door answers whole."""

    def __init__(self, client: HttpClient, request, body: dict, deadline_ms: float) -> None:
        self._body = body
        super().__init__(client, request, deadline_ms)

    async def _run(self) -> AsyncIterator[Chunk]:
        driver = self._driver = HttpCallDriver(
            self._client.retrier, self._client.endpoints, self._client.api_key, self._request, self._deadline_ms
        )
        attempt, response = await self._client._answer(driver, self._body)
        result = driver.answered(attempt, response)
        if result.text:
            yield Chunk(result.text, (), 0)  # emitted_at_us: not said
        self.result = result


class HttpClient:
    """Generate calls through replicas' HTTP doors: `base_urls` as http://host:port, tried as the SDK tries its
    endpoints. Keep-alive HTTP/1.1 connections, `max_connections` of them (the calls open at once: each holds one
    until it is answered), in pools of a few (http_pools.py says why)."""

    def __init__(
        self,
        base_urls: Sequence[str],
        api_key: str,
        *,
        retry: RetryConfig | None = None,
        max_connections: int = 100,
        verify: object = True,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if not base_urls:
            raise ValueError("at least one base URL")
        self.endpoints = tuple(url.rstrip("/") for url in base_urls)
        self.api_key = api_key
        self.pools = HttpPools(max_connections, verify, transport)
        self.retrier = Retrier(retry or RetryConfig(), len(self.endpoints), clock, wall_clock, rand)
        self._sleep = sleep

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        deadline_ms: float | None = None,
        *,
        messages: Sequence | None = None,
        response_format: Mapping[str, object] | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        max_tokens: int = 64,
        model: str = "",
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        request_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        service_class: str = "",
    ) -> HttpGeneration:
        """As AsyncClient.generate, for what /v1/completions takes: a prompt (text or token ids) and sampling; a
        conversation, a response_format, logprobs, top_k or labels are refused (ValueError)."""
        if deadline_ms is None:
            raise TypeError("generate() needs deadline_ms: the call's whole budget, retries included")
        if not deadline_ms > 0:
            raise ValueError(f"deadline_ms must be > 0, got {deadline_ms}")
        given = {"messages": messages, "response_format": response_format, "logprobs": logprobs or None}
        given |= {"top_logprobs": top_logprobs or None, "top_k": top_k or None, "labels": labels or None}
        refused = [name for name, value in given.items() if value is not None]
        if refused:
            raise ValueError(f"the HTTP door's {COMPLETIONS_PATH} takes no {', '.join(refused)}")
        sampling = {"temperature": temperature, "top_p": top_p, "seed": seed, "stop": stop}
        request = build_request(
            prompt, max_tokens, model=model, request_id=request_id, service_class=service_class, **sampling
        )
        body: dict[str, object] = {"prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt]}
        body["max_tokens"] = max_tokens
        optional = {"temperature": temperature, "top_p": top_p, "seed": seed, "stop": list(stop) or None}
        body |= {name: value for name, value in optional.items() if value is not None}
        body["stream"] = False
        return HttpGeneration(self, request, body, deadline_ms)

    async def complete(self, prompt: str | Sequence[int] | None = None, deadline_ms: float | None = None, **options):
        """generate(...) run to its end: its Result."""
        return await self.generate(prompt, deadline_ms, **options).collect()

    def _headers(self, driver: HttpCallDriver, attempt: Attempt) -> dict[str, str]:
        headers = {
            "Authorization": f"Bearer {self.api_key}",
            "X-Budget-Ms": str(round(attempt.timeout_s * 1000)),  # what the call has left (a first try: its budget)
            "X-Request-Id": driver.request_id,
            "X-Stainless-Retry-Count": str(driver.records[-1].number),
        }
        if attempt.request.service_class:
            headers["X-Service-Class"] = attempt.request.service_class
        return headers

    async def _answer(self, driver: HttpCallDriver, body: dict) -> tuple[Attempt, httpx.Response]:
        """Attempts until one is answered 200 (returned) or the driver gives up (its error raised)."""
        while True:
            if driver.delay_s > 0:
                await self._sleep(driver.delay_s)
            attempt = driver.begin()
            response, failure, should_retry = await self._try(driver, attempt, body)
            if response is not None:
                return attempt, response
            error = driver.failed(attempt, failure, should_retry)
            if error is not None:
                raise error

    async def _try(
        self, driver: HttpCallDriver, attempt: Attempt, body: dict
    ) -> tuple[httpx.Response | None, Failure | None, bool]:
        """One attempt: its 200, or why it failed and whether the door invites a retry."""
        if round(attempt.timeout_s * 1000) < 1:
            # a retry's wait outlasted the budget (an event loop running late): as gRPC fails an attempt whose
            # deadline has passed, locally, it is not sent
            return None, Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "no budget left", reason="CLIENT_TIMEOUT"), True
        sent = {**body, "model": attempt.request.model} if attempt.request.model else body
        url = self.endpoints[attempt.endpoint] + COMPLETIONS_PATH
        wait_s = attempt.timeout_s + GRACE_S
        try:
            with self.pools.lease() as http:
                async with asyncio.timeout(wait_s):
                    response = await http.post(url, json=sent, headers=self._headers(driver, attempt), timeout=wait_s)
        except (TimeoutError, httpx.TransportError) as error:
            return None, _transport_failure(error), True
        if response.status_code == 200:
            return response, None, True
        should_retry = response.headers.get("x-should-retry", "").lower() != "false"
        return None, failure_from_response(response), should_retry

    async def close(self) -> None:
        await self.pools.aclose()

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
