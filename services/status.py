"""The one map from domain errors (services/errors.py) to gRPC status codes with rich details.

`rpc_errors` wraps a handler: a domain error becomes a status with google.rpc details (BadRequest, ErrorInfo,
RetryInfo) and trailing metadata. Anything else that escapes a handler is a bug: it is logged with its
stack and answered INTERNAL with an ErrorInfo naming the request, never a bare UNKNOWN.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from billing import errors as billing

from .errors import (
    DOMAIN,
    MAX_VIOLATIONS,
    DeadlineInfeasible,
    InvalidArgument,
    Overloaded,
    QuotaExceeded,
    ServiceError,
    clip,
)

log = structlog.get_logger(__name__)
# Every status stays well inside the 8 KiB soft limit of gRPC's metadata (16 KiB hard): above the soft limit a
# client drops some replies as "received metadata size exceeds ..." RESOURCE_EXHAUSTED, which reads as overload.
# The message travels twice (grpc-message, percent-encoded: up to 3 bytes per byte; and inside the base64
# grpc-status-details-bin), so: a message of at most 512 bytes, a whole google.rpc.Status of at most 3 KiB.
MAX_STATUS_MESSAGE_BYTES = 512
MAX_STATUS_BYTES = 3072


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
    if isinstance(error, QuotaExceeded):
        violation = error_details_pb2.QuotaFailure.Violation(subject=error.subject, description=error.description)
        details.append(error_details_pb2.QuotaFailure(violations=[violation]))
    if isinstance(error, (Overloaded, QuotaExceeded)):
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
    how many), then keeps only the ErrorInfo's reason, any RetryInfo and any QuotaFailure."""
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
            if isinstance(d, (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo, error_details_pb2.QuotaFailure))
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


class rpc_errors:  # noqa: N801 - used as `async with rpc_errors(...)`, as the function it once was
    """Wraps one RPC handler: domain errors become their status; an unexpected error is logged as a bug.
    `before_abort` sees the code of a domain error's status just before it is handed to gRPC.

    A class, not an @asynccontextmanager: a refusal is the common answer under overload, and a generator-based
    context manager costs it a generator, an athrow and a second traceback (~40 µs of the ~190 µs a refusal
    spends in this process's Python, measured in place)."""

    __slots__ = ("context", "method", "request_id", "before_abort")

    def __init__(
        self,
        context: grpc.aio.ServicerContext,
        method: str,
        request_id: str = "",
        before_abort: Callable[[grpc.StatusCode], None] | None = None,
    ) -> None:
        self.context, self.method, self.request_id, self.before_abort = context, method, request_id, before_abort

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind, error, traceback) -> bool:
        if error is None or isinstance(error, grpc.aio.AbortError):
            return False
        if isinstance(error, (ServiceError, billing.BillingError)):
            status = status_for(error)
            grpc_status = to_grpc_status(status)
            if self.before_abort is not None:
                self.before_abort(status.code)
            if status.code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                # on the loop's next turn, once the reply is on its way: rendering it (~20 µs, several times that
                # under load) is not part of the caller's wait. A refusal for load is not logged at all
                # (zeroqueue_rejections and zeroqueue_refusals_total count them): an overload refuses hundreds a
                # second, and the log must not be what takes the engine's CPU
                asyncio.get_running_loop().call_soon(
                    functools.partial(
                        log.info, "rpc_error", method=self.method, request_id=self.request_id,
                        code=status.code.name, reason=error.reason,
                    )
                )  # fmt: skip
            await self.context.abort_with_status(grpc_status)  # raises AbortError: the status is the answer
            return True
        if not isinstance(error, Exception):
            return False  # CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit: not an RPC's failure
        # last resort: a bug, answered INTERNAL with an ErrorInfo
        log.error("rpc_unexpected_error", method=self.method, request_id=self.request_id, exc_info=error)
        await self.context.abort_with_status(to_grpc_status(status_for(error)))
        return False
