"""Typed domain errors and the one map from them to gRPC status codes with rich details.

Handlers raise these; `rpc_errors` turns them into a status with google.rpc details (BadRequest, ErrorInfo,
RetryInfo) and trailing metadata. Anything else that escapes a handler is a bug: it is logged with its
stack and answered INTERNAL with an ErrorInfo naming the request, never a bare UNKNOWN.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from billing import errors as billing

log = structlog.get_logger(__name__)
DOMAIN = "zeroqueue.dev"
# Every status stays well inside the 8 KiB soft limit of gRPC's metadata (16 KiB hard): above the soft limit a
# client drops some replies as "received metadata size exceeds ..." RESOURCE_EXHAUSTED, which reads as overload.
# The message travels twice (grpc-message, percent-encoded: up to 3 bytes per byte; and inside the base64
# grpc-status-details-bin), so: a message of at most 512 bytes, a whole google.rpc.Status of at most 3 KiB.
MAX_ECHO_CHARS = 64  # what a status repeats of a client's string
MAX_VIOLATIONS = 20  # field violations listed; one more says how many were left out
MAX_STATUS_MESSAGE_BYTES = 512
MAX_STATUS_BYTES = 3072


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL
    reason = "INTERNAL"

    def __init__(self, message: str, metadata: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = metadata or {}


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


def clip(text: str, max_chars: int = MAX_ECHO_CHARS) -> str:
    """`text` cut to `max_chars` characters, with an ellipsis when it was longer: for echoing what a client sent."""
    return text if len(text) <= max_chars else text[:max_chars] + "…"


class InvalidArgument(ServiceError):
    """One or more request fields are wrong; `violations` name them (the status lists at most MAX_VIOLATIONS)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"

    def __init__(self, violations: list[FieldViolation], code: grpc.StatusCode | None = None) -> None:
        listed = "; ".join(f"{v.field}: {v.description}" for v in violations[:MAX_VIOLATIONS])
        more = len(violations) - MAX_VIOLATIONS
        super().__init__(listed + (f"; and {more} more" if more > 0 else ""))
        self.violations = violations
        if code is not None:
            self.code = code


class MalformedRequest(InvalidArgument):
    """The request's bytes are not a message of the method's type: corrupt wire format, or a string field that is
    not UTF-8. `problem` names the field when it can be found."""

    reason = "MALFORMED_REQUEST"

    def __init__(self, message_type: str, problem: FieldViolation | None = None, detail: str = "") -> None:
        named = problem is not None and bool(problem.field)
        super().__init__([problem] if named else [])
        why = (
            f"{problem.field} {problem.description}"
            if named
            else problem.description
            if problem is not None
            else clip(detail or "corrupt wire format", 128)
        )
        self.message = f"the request is not a valid {message_type}: {why}"
        self.metadata = {"message_type": message_type}


class RequestTooLarge(InvalidArgument):
    """The request's bytes exceed what any valid request of the method can hold; refused before parsing.
    `largest` names the field that holds most of them."""

    code = grpc.StatusCode.OUT_OF_RANGE
    reason = "REQUEST_TOO_LARGE"

    def __init__(self, size_bytes: int, max_bytes: int, largest: FieldViolation | None = None) -> None:
        super().__init__([largest] if largest is not None else [])
        self.message = f"the request is {size_bytes} bytes; this method accepts at most {max_bytes}" + (
            f" ({largest.field} {largest.description})" if largest is not None else ""
        )
        self.metadata = {"size_bytes": str(size_bytes), "max_bytes": str(max_bytes)}


class Overloaded(ServiceError):
    """Admission does not take the call now; capacity for it frees after retry_after_ms. `cause` says why not
    now (admission's Reject.reason) and `reserved` whether a slot, or its turn, is held for a retry then: the
    message and the ErrorInfo say the same."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "OVERLOADED"

    def __init__(
        self,
        retry_after_ms: int,
        predicted_finish_ms: int,
        budget_ms: int,
        within_budget: bool = True,
        cause: str = "deadline",
        reserved: bool = False,
    ) -> None:
        # a hint at or past the call's remaining time is for another replica or a fresh call, never this one
        self.within_budget = within_budget and retry_after_ms < budget_ms
        self.reserved = reserved and self.within_budget
        self.retry_after_ms = retry_after_ms
        why = _WHY.get(cause, _WHY["deadline"]).format(finish=predicted_finish_ms, budget=budget_ms)
        super().__init__(
            f"{why}; {self._next_step(cause == 'step_budget')}",
            {
                "retry_after_ms": str(retry_after_ms),
                "predicted_finish_ms": str(predicted_finish_ms),
                "budget_ms": str(budget_ms),
                "retry_within_budget": str(self.within_budget).lower(),
                "cause": cause,
                "retry_reserved": str(self.reserved).lower(),
            },
        )

    def _next_step(self, for_turn: bool) -> str:
        hint, held = self.retry_after_ms, "its turn is held" if for_turn else "a slot is reserved for it"
        if not self.within_budget:
            return f"no retry fits inside this budget; this replica frees up in {hint} ms (try another replica)"
        if self.reserved:
            return f"retry in {hint} ms: {held} from then"
        return f"retry in {hint} ms is a best guess: nothing is held for it (every reservation is taken)"

    @property
    def pushback_ms(self) -> int:
        """grpc-retry-pushback-ms. gRFC A6 clients sleep a positive pushback even past the call's deadline, so a
        hint that does not fit the remaining time says -1 (do not retry): the app hears the refusal at once.
        An unbacked hint that fits is still a positive pushback: a best guess beats a refusal the app can do
        nothing with but wait the same time, and a retry that misses is refused in a millisecond (with a -1 once
        no hint fits)."""
        return self.retry_after_ms if self.within_budget else -1


_WHY = {
    "slots_full": "slots full: every slot is taken, by running calls or reserved retries, at some point of its "
    "predicted run ({finish} ms of a {budget} ms budget)",
    "step_budget": "the next engine steps' token budget is taken by prompts ahead of it (its run would end in "
    "{finish} ms of a {budget} ms budget)",
    "deadline": "predicted finish in {finish} ms exceeds the budget of {budget} ms, less the safety margin, under "
    "the current load",
    "delays_admitted": "joining now would push an admitted call past its deadline (its own predicted finish, "
    "{finish} ms, fits the budget of {budget} ms)",
}


class DeadlineInfeasible(ServiceError):
    """Even an idle server could not finish inside the budget: retrying with it is pointless."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_INFEASIBLE"

    def __init__(self, budget_ms: int, min_budget_ms: int) -> None:
        super().__init__(
            f"a budget of {budget_ms} ms cannot be met even on an idle server; "
            f"the minimum feasible budget is {min_budget_ms} ms",
            {"min_budget_ms": str(min_budget_ms), "budget_ms": str(budget_ms)},
        )


class DeadlineExpired(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_EXPIRED"


class DeadlineMissed(ServiceError):
    """An admitted request ran out of time (the cost model mispredicted); it counts as a deadline miss."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_MISSED"


class NotServing(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "NOT_SERVING"


class RequestIdInUse(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "REQUEST_ID_IN_USE"


class EngineFailure(ServiceError):
    code = grpc.StatusCode.INTERNAL
    reason = "ENGINE_FAILURE"


# The ledger database refused or dropped the connection, or a transaction lost a lock race: nothing was committed,
# and the same call may be retried. A billing error (billing.db.ledger_errors makes it from SQLAlchemy's), mapped
# to UNAVAILABLE by _BILLING_CODES like every billing.Unavailable.
LedgerUnavailable = billing.LedgerUnavailable


class UsageNotRecorded(ServiceError):
    """The request ran but its usage record could not be made durable; it is not reported as done."""

    code = grpc.StatusCode.INTERNAL
    reason = "USAGE_NOT_RECORDED"


class AuthUnavailable(ServiceError):
    """The service that checks API keys could not be asked; the key is neither accepted nor refused."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "AUTH_UNAVAILABLE"


_BILLING_CODES = {
    billing.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    billing.NotFound: grpc.StatusCode.NOT_FOUND,
    billing.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    billing.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    billing.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    billing.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    billing.Unavailable: grpc.StatusCode.UNAVAILABLE,
}


@dataclass(frozen=True)
class RpcStatus:
    code: grpc.StatusCode
    message: str
    details: list = field(default_factory=list)
    trailing_metadata: tuple[tuple[str, str], ...] = ()


def _pack(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _server_time() -> tuple[str, str]:
    return ("x-server-time", str(time.time_ns() // 1000))


def status_for(error: Exception) -> RpcStatus:
    """The one place where a domain error becomes a gRPC status."""
    if isinstance(error, billing.BillingError):
        code = next(c for cls, c in _BILLING_CODES.items() if isinstance(error, cls))
        details = [error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN)]
        if error.field and code == grpc.StatusCode.INVALID_ARGUMENT:
            details.append(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(field=error.field, description=error.message)
                    ]
                )
            )
        return RpcStatus(code, error.message, details)
    if not isinstance(error, ServiceError):
        return RpcStatus(
            grpc.StatusCode.INTERNAL,
            "unexpected server error; it has been logged",
            [error_details_pb2.ErrorInfo(reason="UNEXPECTED", domain=DOMAIN)],
        )
    details = [error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=error.metadata)]
    trailing = [_server_time()]
    if isinstance(error, InvalidArgument) and error.violations:
        listed = [
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in error.violations[:MAX_VIOLATIONS]
        ]
        if len(error.violations) > MAX_VIOLATIONS:
            listed.append(_more(len(error.violations) - MAX_VIOLATIONS))
        details.append(error_details_pb2.BadRequest(field_violations=listed))
    if isinstance(error, Overloaded):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(error.retry_after_ms)
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        trailing += [("retry-after-ms", str(error.retry_after_ms)), ("grpc-retry-pushback-ms", str(error.pushback_ms))]
    elif isinstance(error, DeadlineInfeasible):
        trailing.append(("grpc-retry-pushback-ms", "-1"))  # tells gRPC retry policies not to retry
    return RpcStatus(error.code, error.message, details, tuple(trailing))


_MORE = re.compile(r"and ([0-9]{1,9}) more not listed")


def _more(count: int) -> error_details_pb2.BadRequest.FieldViolation:
    return error_details_pb2.BadRequest.FieldViolation(field="", description=f"and {count} more not listed")


def _clip_bytes(text: str, max_bytes: int) -> str:
    data = text.encode()
    return text if len(data) <= max_bytes else data[: max_bytes - 3].decode(errors="ignore") + "…"


def _clipped(detail):
    """A detail whose every string is short: what is left when a status is still too large."""
    if isinstance(detail, error_details_pb2.BadRequest):
        return error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=clip(v.field, 128), description=clip(v.description, 256)
                )
                for v in detail.field_violations
            ]
        )
    if isinstance(detail, error_details_pb2.ErrorInfo):
        return error_details_pb2.ErrorInfo(
            reason=detail.reason,
            domain=detail.domain,
            metadata={clip(k): clip(v, 128) for k, v in list(detail.metadata.items())[:16]},
        )
    return detail


def _bounded(status: RpcStatus) -> status_pb2.Status:
    """The google.rpc.Status of `status`, at most MAX_STATUS_BYTES whatever went into it: the safety net behind
    every refusal's own bounds. Clips its strings first, then drops field violations from the end (one more says
    how many), then keeps only the ErrorInfo's reason and any RetryInfo."""
    code = getattr(code_pb2, status.code.name)
    message = _clip_bytes(status.message, MAX_STATUS_MESSAGE_BYTES)
    proto = status_pb2.Status(code=code, message=message, details=[_pack(d) for d in status.details])
    if proto.ByteSize() <= MAX_STATUS_BYTES:
        return proto
    details = [_clipped(d) for d in status.details]
    bad = next((d for d in details if isinstance(d, error_details_pb2.BadRequest)), None)
    if bad is not None:
        violations, hidden = list(bad.field_violations), 0
        more = _MORE.fullmatch(violations[-1].description) if violations and not violations[-1].field else None
        if more is not None:
            hidden = int(more[1])
            violations.pop()
        while True:
            listed = violations + ([_more(hidden)] if hidden else [])
            del bad.field_violations[:]
            bad.field_violations.extend(listed)
            proto = status_pb2.Status(code=code, message=message, details=[_pack(d) for d in details])
            if proto.ByteSize() <= MAX_STATUS_BYTES or len(violations) <= 1:
                break
            violations.pop()
            hidden += 1
    if proto.ByteSize() > MAX_STATUS_BYTES:
        details = [
            error_details_pb2.ErrorInfo(reason=clip(d.reason), domain=d.domain)
            if isinstance(d, error_details_pb2.ErrorInfo)
            else d
            for d in status.details
            if isinstance(d, (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo))
        ]
        proto = status_pb2.Status(code=code, message=message, details=[_pack(d) for d in details])
    return proto


def to_grpc_status(status: RpcStatus) -> grpc.Status:
    """The status as gRPC sends it, its message and details within MAX_STATUS_BYTES (see `_bounded`)."""
    proto = _bounded(status)
    converted = rpc_status.to_status(proto)
    return _Status(converted.code, converted.details, converted.trailing_metadata + status.trailing_metadata)


@dataclass(frozen=True)
class _Status(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple


@contextlib.asynccontextmanager
async def rpc_errors(
    context: grpc.aio.ServicerContext,
    method: str,
    request_id: str = "",
    before_abort: Callable[[grpc.StatusCode], None] | None = None,
) -> AsyncIterator[None]:
    """Wraps one RPC handler: domain errors become their status; an unexpected error is logged as a bug.
    `before_abort` sees the code of a domain error's status just before it is handed to gRPC."""
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except (ServiceError, billing.BillingError) as error:
        status = status_for(error)
        grpc_status = to_grpc_status(status)
        if before_abort is not None:
            before_abort(status.code)
        # the log line runs on the loop's next turn, once the reply is on its way: rendering it (~20 µs in a
        # tight loop, several times that under load) is not part of the caller's wait for "no". A refusal
        # for load is a debug line (zeroqueue_rejections counts them): an overload refuses hundreds a second,
        # and the log must not be what takes the engine's CPU
        emit = log.debug if status.code is grpc.StatusCode.RESOURCE_EXHAUSTED else log.info
        asyncio.get_running_loop().call_soon(
            functools.partial(
                emit, "rpc_error", method=method, request_id=request_id, code=status.code.name, reason=error.reason
            )
        )
        await context.abort_with_status(grpc_status)
    except Exception as error:  # noqa: BLE001 - last resort: a bug, answered INTERNAL with an ErrorInfo
        log.exception("rpc_unexpected_error", method=method, request_id=request_id)
        await context.abort_with_status(to_grpc_status(status_for(error)))
