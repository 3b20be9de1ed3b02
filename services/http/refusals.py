"""A refusal over HTTP: the same domain error the gRPC door raises (services/errors.py, its code from the one map in
services/status.py) as an HTTP status, the headers the official SDKs obey, and each API's own error body carrying
what ErrorInfo carries (reason, cause, the retry hint, retry_within_budget) and the field violations.

429 (overload, quota) says `Retry-After` in whole seconds rounded up (RFC 9110) and `retry-after-ms` exactly;
`x-should-retry` says whether a retry here is invited, so an SDK neither retries a hint past its budget nor gives up
on one it should take. Every reply says `X-Server-Time` (µs since the epoch) to check a client's clock against."""

from __future__ import annotations

import math
import time

import grpc

from billing import errors as billing
from services import errors
from services.status import status_for

from .calls import Call

MAX_MESSAGE_CHARS = 1024
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_BY_REASON = {  # where a reason says more than its gRPC code
    "DEADLINE_INFEASIBLE": 400,  # the budget itself is wrong: a 4xx, never retried
    "DEADLINE_EXPIRED": 408,  # the budget was spent before the call arrived
    "BODY_TIMEOUT": 408,
    "REQUEST_TOO_LARGE": 413,
    "HEADERS_TOO_LARGE": 431,
    "METHOD_NOT_ALLOWED": 405,
}
_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    431: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
_RETRY_HERE = frozenset({"NOT_SERVING", "AUTH_UNAVAILABLE", "LEDGER_UNAVAILABLE"})  # 503s that pass: retry here
_NOT_SERVING_RETRY_S = 1  # a warming replica's Retry-After: it does not know when it will be ready


def server_time() -> str:
    return str(time.time_ns() // 1000)


def _violations(error: Exception, call: Call | None) -> list[dict]:
    if isinstance(error, errors.InvalidArgument):
        found = error.violations[: errors.MAX_VIOLATIONS]
        name = call.api_field if call is not None else str
        return [{"field": name(v.field), "description": v.description} for v in found]
    if isinstance(error, billing.BillingError) and error.field:
        return [{"field": error.field, "description": error.message}]
    return []


def _retry_headers(error: Exception, status: int) -> dict[str, str]:
    """The retry hint as the SDKs read it; x-should-retry says whether a retry here is invited."""
    if isinstance(error, (errors.Overloaded, errors.QuotaExceeded)):
        ms = error.retry_after_ms
        headers = {"retry-after": str(math.ceil(ms / 1000)), "retry-after-ms": str(ms)}
        headers["x-should-retry"] = "true" if error.within_budget else "false"
        if isinstance(error, errors.QuotaExceeded):
            headers |= {f"x-quota-{k.replace('_', '-')}": v for k, v in error.metadata.items() if k != "retry_after_ms"}
        return headers
    if status == 503:
        # a warming replica, or a passing outage of its key check or ledger, will take the call here soon; a
        # draining one or a failed device will not (the caller's other replicas will)
        draining = getattr(error, "metadata", {}).get("state") == "draining"
        retry_here = getattr(error, "reason", "") in _RETRY_HERE and not draining
        return {"retry-after": str(_NOT_SERVING_RETRY_S), "x-should-retry": "true" if retry_here else "false"}
    if isinstance(error, errors.DeadlineInfeasible):
        return {"x-should-retry": "false", "x-min-budget-ms": error.metadata["min_budget_ms"]}
    if status in (408, 409) or status >= 500:
        # 408 and 409 the SDKs retry by default: a spent budget, an id still in use, a failure here is not
        # helped by the same call again at once (and a 500 retried might run, and bill, the call twice)
        return {"x-should-retry": "false"}
    return {}


def refusal(error: Exception, call: Call | None, anthropic: bool) -> tuple[int, dict[str, str], dict]:
    """(HTTP status, headers, the API's error body) for a domain error: the one map's code, then the reasons that
    say more. Anything not a domain error is a bug: 500 with reason UNEXPECTED (the caller logs it)."""
    rpc = status_for(error)
    known = isinstance(error, (errors.ServiceError, billing.BillingError))
    reason = error.reason if known else "UNEXPECTED"
    status = _BY_REASON.get(reason, _STATUS.get(rpc.code, 500))
    message = rpc.message if len(rpc.message) <= MAX_MESSAGE_CHARS else rpc.message[:MAX_MESSAGE_CHARS] + "…"
    metadata = dict(getattr(error, "metadata", {}) or {}) if reason != "UNEXPECTED" else {}
    violations = _violations(error, call)
    detail = {
        "message": message,
        "type": _TYPE.get(status, "api_error"),
        "param": violations[0]["field"] if violations else None,
        "code": reason,
        "error_info": {"reason": reason, "domain": errors.DOMAIN, "metadata": metadata},
    }
    if violations:
        detail["field_violations"] = violations
    headers = {"x-server-time": server_time(), **_retry_headers(error, status)}
    body = {"type": "error", "error": detail} if anthropic else {"error": detail}
    return status, headers, body
