"""Typed domain errors and the one map from them to gRPC status codes with rich details.

Handlers raise these; `rpc_errors` turns them into a status with google.rpc details (BadRequest, ErrorInfo,
RetryInfo) and trailing metadata. Anything else that escapes a handler is a bug: it is logged with its
stack and answered INTERNAL with an ErrorInfo naming the request, never a bare UNKNOWN.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
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


class InvalidArgument(ServiceError):
    """One or more request fields are wrong; `violations` name them."""
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"

    def __init__(self, violations: list[FieldViolation], code: grpc.StatusCode | None = None) -> None:
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in violations))
        self.violations = violations
        if code is not None:
            self.code = code


class Overloaded(ServiceError):
    """Admission predicts the deadline would be missed now; capacity frees after retry_after_ms."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "OVERLOADED"

    def __init__(self, retry_after_ms: int, predicted_finish_ms: int, budget_ms: int,
                 within_budget: bool = True) -> None:
        when = (f"retry after {retry_after_ms} ms" if within_budget else
                f"no room inside this budget; this replica frees up in {retry_after_ms} ms (try another replica)")
        super().__init__(f"predicted finish in {predicted_finish_ms} ms exceeds the budget of {budget_ms} ms under "
                         f"the current load; {when}",
                         {"retry_after_ms": str(retry_after_ms), "predicted_finish_ms": str(predicted_finish_ms),
                          "budget_ms": str(budget_ms), "retry_within_budget": str(within_budget).lower()})
        self.retry_after_ms = retry_after_ms


class DeadlineInfeasible(ServiceError):
    """Even an idle server could not finish inside the budget: retrying with it is pointless."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_INFEASIBLE"

    def __init__(self, budget_ms: int, min_budget_ms: int) -> None:
        super().__init__(f"a budget of {budget_ms} ms cannot be met even on an idle server; "
                         f"the minimum feasible budget is {min_budget_ms} ms",
                         {"min_budget_ms": str(min_budget_ms), "budget_ms": str(budget_ms)})


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


class LedgerUnavailable(ServiceError):
    """The ledger database refused or dropped the connection, or a transaction lost a lock race:
    nothing was committed, and the same call may be retried."""
    code = grpc.StatusCode.UNAVAILABLE
    reason = "LEDGER_UNAVAILABLE"


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
            details.append(error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=error.field, description=error.message)]))
        return RpcStatus(code, error.message, details)
    if not isinstance(error, ServiceError):
        return RpcStatus(grpc.StatusCode.INTERNAL, "unexpected server error; it has been logged",
                         [error_details_pb2.ErrorInfo(reason="UNEXPECTED", domain=DOMAIN)])
    details = [error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=error.metadata)]
    trailing = [_server_time()]
    if isinstance(error, InvalidArgument):
        details.append(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in error.violations]))
    if isinstance(error, Overloaded):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(error.retry_after_ms)
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        trailing += [("retry-after-ms", str(error.retry_after_ms)),
                     ("grpc-retry-pushback-ms", str(error.retry_after_ms))]
    elif isinstance(error, DeadlineInfeasible):
        trailing.append(("grpc-retry-pushback-ms", "-1"))     # tells gRPC retry policies not to retry
    return RpcStatus(error.code, error.message, details, tuple(trailing))


def to_grpc_status(status: RpcStatus) -> grpc.Status:
    proto = status_pb2.Status(code=getattr(code_pb2, status.code.name), message=status.message,
                              details=[_pack(d) for d in status.details])
    converted = rpc_status.to_status(proto)
    return _Status(converted.code, converted.details, converted.trailing_metadata + status.trailing_metadata)


@dataclass(frozen=True)
class _Status(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple


@contextlib.asynccontextmanager
async def rpc_errors(context: grpc.aio.ServicerContext, method: str, request_id: str = "",
                     before_abort: Callable[[grpc.StatusCode], None] | None = None) -> AsyncIterator[None]:
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
        asyncio.get_running_loop().call_soon(functools.partial(
            emit, "rpc_error", method=method, request_id=request_id, code=status.code.name,
            reason=error.reason))
        await context.abort_with_status(grpc_status)
    except Exception as error:  # noqa: BLE001 - last resort: a bug, answered INTERNAL with an ErrorInfo
        log.exception("rpc_unexpected_error", method=method, request_id=request_id)
        await context.abort_with_status(to_grpc_status(status_for(error)))
