"""Typed exceptions for callers of the SDK, one per thing a caller can do something about.

Every one carries the `failure` (code, message, ErrorInfo reason and metadata) and the call's `report`
(its attempts and time spent waiting), so a caller can log how the call went even when it failed.
"""

from __future__ import annotations

import grpc

from .results import CallReport
from .status import Failure, FieldViolation


class ZeroQueueError(Exception):
    def __init__(self, failure: Failure, report: CallReport) -> None:
        super().__init__(f"{failure.code.name}: {failure.message}" if failure.message else failure.code.name)
        self.failure = failure
        self.report = report

    @property
    def code(self) -> grpc.StatusCode:
        return self.failure.code

    @property
    def reason(self) -> str:
        return self.failure.reason


class Rejected(ZeroQueueError):
    """Every replica tried said OVERLOADED and waiting for the hint would have passed the call's deadline."""

    @property
    def retry_after_ms(self) -> int | None:
        return self.failure.retry_after_ms


class DeadlineInfeasible(ZeroQueueError):
    """Even an idle replica could not finish inside this budget: ask for fewer tokens or allow more time."""

    @property
    def min_budget_ms(self) -> int | None:
        value = self.failure.error_metadata.get("min_budget_ms")
        return int(value) if value is not None and value.isdigit() else None


class DeadlineExceeded(ZeroQueueError):
    """The call's budget ran out: it expired in flight, or the replica ended it at its deadline."""


class Unavailable(ZeroQueueError):
    """No replica could serve (warming up, draining, unreachable) before the deadline or the attempts ran out."""


class InvalidRequest(ZeroQueueError):
    """INVALID_ARGUMENT or OUT_OF_RANGE; `violations` name the fields."""

    @property
    def violations(self) -> tuple[FieldViolation, ...]:
        return self.failure.violations


class Unauthenticated(ZeroQueueError):
    pass


class PermissionDenied(ZeroQueueError):
    pass


class RequestIdInUse(ZeroQueueError):
    """ALREADY_EXISTS: a call with this request_id is already running on that replica."""


class ServerError(ZeroQueueError):
    """Any other status (INTERNAL, CANCELLED, ...): not something a retry of the same call should paper over."""


_BY_CODE = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: Rejected,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.ALREADY_EXISTS: RequestIdInUse,
}


def error_for(failure: Failure, report: CallReport) -> ZeroQueueError:
    if failure.code == grpc.StatusCode.DEADLINE_EXCEEDED and failure.reason == "DEADLINE_INFEASIBLE":
        return DeadlineInfeasible(failure, report)
    return _BY_CODE.get(failure.code, ServerError)(failure, report)
