"""A failed call in client terms: its code plus what the server's google.rpc details and trailers said.

Read from the call's trailing metadata (`grpc-status-details-bin` is a google.rpc.Status), so the sync and
asyncio transports share one parser.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import grpc
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"
QUOTA_EXCEEDED = "QUOTA_EXCEEDED"  # ErrorInfo.reason of a refusal for a tenant's quota, not for load
_DETAILS = (
    error_details_pb2.ErrorInfo,
    error_details_pb2.RetryInfo,
    error_details_pb2.BadRequest,
    error_details_pb2.QuotaFailure,
)


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


@dataclass(frozen=True)
class QuotaViolation:
    subject: str  # e.g. tenant:acme
    description: str  # e.g. device_us_per_month: 3600000000 of 3600000000 used


@dataclass(frozen=True)
class Failure:
    code: grpc.StatusCode
    message: str
    reason: str = ""  # ErrorInfo.reason, e.g. OVERLOADED, DEADLINE_INFEASIBLE
    error_metadata: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    retry_after_ms: int | None = None  # RetryInfo, else the retry-after-ms trailer
    server_time_us: int | None = None  # x-server-time: the server's clock when it answered
    violations: tuple[FieldViolation, ...] = ()  # google.rpc.BadRequest
    after_admission: bool = False  # the server had admitted the call (stream had begun)
    num_tokens_delivered: int = 0
    quota_violations: tuple[QuotaViolation, ...] = ()  # google.rpc.QuotaFailure

    @property
    def is_quota(self) -> bool:
        """A refusal for the tenant's quota (its cap, not the replica's load): no other replica takes it either."""
        return self.code == grpc.StatusCode.RESOURCE_EXHAUSTED and (
            self.reason == QUOTA_EXCEEDED or bool(self.quota_violations)
        )


def _text(value: str | bytes) -> str:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _details(raw: bytes | None) -> dict[str, object]:
    """The first detail of each known type, by its name (ErrorInfo, RetryInfo, BadRequest, QuotaFailure)."""
    found: dict[str, object] = {}
    if raw:
        try:
            status = status_pb2.Status.FromString(raw)
        except Exception:  # noqa: BLE001 - a malformed details blob from a proxy: treat as absent
            return {}
        for packed in status.details:
            for cls in _DETAILS:
                if packed.Is(cls.DESCRIPTOR) and cls.DESCRIPTOR.name not in found:
                    message = cls()
                    packed.Unpack(message)
                    found[cls.DESCRIPTOR.name] = message
    return found


def parse_failure(
    code: grpc.StatusCode,
    message: str | None,
    trailing: Iterable[tuple[str, str | bytes]] | None,
    after_admission: bool = False,
    num_tokens_delivered: int = 0,
) -> Failure:
    pairs: dict[str, str | bytes] = {}
    for key, value in trailing or ():
        pairs.setdefault(key.lower(), value)
    raw = pairs.get(STATUS_DETAILS_KEY)
    found = _details(raw if isinstance(raw, bytes) else None)
    info, retry, bad, quota = (found.get(cls.DESCRIPTOR.name) for cls in _DETAILS)
    retry_after_ms = retry.retry_delay.ToMilliseconds() if retry is not None else None
    if retry_after_ms is None and "retry-after-ms" in pairs:
        retry_after_ms = _int(_text(pairs["retry-after-ms"]))
    server_time = pairs.get("x-server-time")
    return Failure(
        code=code,
        message=message or "",
        reason=info.reason if info else "",
        error_metadata=MappingProxyType(dict(info.metadata) if info else {}),
        retry_after_ms=retry_after_ms,
        server_time_us=_int(_text(server_time)) if server_time is not None else None,
        violations=tuple(FieldViolation(v.field, v.description) for v in (bad.field_violations if bad else ())),
        after_admission=after_admission,
        num_tokens_delivered=num_tokens_delivered,
        quota_violations=tuple(QuotaViolation(v.subject, v.description) for v in (quota.violations if quota else ())),
    )


def failure_from_rpc(error: grpc.RpcError, after_admission: bool = False, num_tokens_delivered: int = 0) -> Failure:
    """From a sync grpc.RpcError (a call) or a grpc.aio.AioRpcError: both have code/details/trailing_metadata."""
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return parse_failure(error.code(), error.details(), trailing, after_admission, num_tokens_delivered)
