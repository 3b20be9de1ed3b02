"""Typed exceptions for callers of the SDK, one per thing a caller can do something about.

Every one carries the `failure` (code, message, ErrorInfo reason and metadata) and the call's `report`
(its attempts and time spent waiting), so a caller can log how the call went even when it failed.
"""

from __future__ import annotations

import grpc

from .failure import Failure, FieldViolation
from .results import CallReport


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

    @property
    def cause(self) -> str:
        """Why the last replica refused: slots_full, step_budget, ..., or compiles (it was compiling as many new
        response_format grammars as it compiles at once); "" when it did not say."""
        return self.failure.error_metadata.get("cause", "")


class QuotaExceeded(ZeroQueueError):
    """The tenant is at one of its caps (RESOURCE_EXHAUSTED, QUOTA_EXCEEDED): a monthly one (device time, spend)
    until `resets_at_us`, or its calls per second. Not overload: no replica takes the call before the cap lifts, so
    the SDK tried no other (and this one again only after its hint, when that fitted the deadline)."""

    @property
    def cap(self) -> str:
        """device_us_per_month, spend_micros_per_month or calls_per_s."""
        return self.failure.error_metadata.get("cap", "")

    @property
    def limit(self) -> int | None:
        return _int(self.failure.error_metadata.get("limit"))

    @property
    def used(self) -> int | None:
        return _int(self.failure.error_metadata.get("used"))

    @property
    def resets_at_us(self) -> int | None:
        """When a monthly cap resets (epoch µs, the server's clock); None for calls per second."""
        return _int(self.failure.error_metadata.get("resets_at_us"))

    @property
    def retry_after_ms(self) -> int | None:
        """How long until the cap lifts, as the server said."""
        return self.failure.retry_after_ms


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


class DeadlineInfeasible(ZeroQueueError):
    """Even an idle replica could not finish inside this budget: ask for fewer tokens or allow more time."""

    @property
    def min_budget_ms(self) -> int | None:
        return _int(self.failure.error_metadata.get("min_budget_ms"))

    @property
    def compile_ms(self) -> int | None:
        """When compiling the call's response_format alone takes longer than its budget: about how long it takes
        (the compile goes on, and a later call with the same format may find it cached); None otherwise."""
        return _int(self.failure.error_metadata.get("compile_ms"))


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
    if failure.is_quota:
        return QuotaExceeded(failure, report)
    return _BY_CODE.get(failure.code, ServerError)(failure, report)
