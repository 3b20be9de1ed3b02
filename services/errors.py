"""Typed domain errors: each names its gRPC status code and its ErrorInfo reason.

Handlers raise these; `services.status.rpc_errors` turns them into a status with google.rpc details
(BadRequest, ErrorInfo, RetryInfo) and trailing metadata, through the one map in services/status.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from billing import errors as billing
from services.inference.admission.decisions import RefusalCause

DOMAIN = "zeroqueue.dev"
MAX_ECHO_CHARS = 64  # what a status repeats of a client's string
MAX_VIOLATIONS = 20  # field violations listed; one more says how many were left out


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
    now (admission's Reject.reason) and `reserved` whether a slot, or its turn, is held for a retry then;
    `elsewhere` whether other replicas serve the same model (`zeroqueue serve --elsewhere`), so that a refusal
    inviting no retry here points at them, or says there is none: the message and the ErrorInfo say the same."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "OVERLOADED"

    def __init__(
        self,
        retry_after_ms: int,
        predicted_finish_ms: int,
        budget_ms: int,
        within_budget: bool = True,
        cause: RefusalCause = RefusalCause.DEADLINE,
        reserved: bool = False,
        saturated: bool = False,
        elsewhere: bool = True,
    ) -> None:
        # a hint at or past the call's remaining time is for another replica or a fresh call, never this one
        self.within_budget = within_budget and retry_after_ms < budget_ms and not saturated
        self.saturated = saturated
        self.elsewhere = elsewhere
        self.reserved = reserved and self.within_budget
        self.retry_after_ms = retry_after_ms
        why = _WHY.get(cause, _WHY[RefusalCause.DEADLINE]).format(finish=predicted_finish_ms, budget=budget_ms)
        super().__init__(
            f"{why}; {self._next_step(cause, cause in _HOLDS_NOTHING)}",
            {
                "retry_after_ms": str(retry_after_ms),
                "predicted_finish_ms": str(predicted_finish_ms),
                "budget_ms": str(budget_ms),
                "retry_within_budget": str(self.within_budget).lower(),
                "cause": str(cause),
                "retry_reserved": str(self.reserved).lower(),
                "saturated": str(saturated).lower(),
                "elsewhere": str(elsewhere).lower(),
            },
        )

    def _next_step(self, cause: RefusalCause, holds_nothing: bool) -> str:
        hint, held = self.retry_after_ms, _HELD.get(cause, "a slot is reserved for it")
        go = "try another replica" if self.elsewhere else "there is no other replica to try"
        if self.saturated and self.elsewhere:
            return (
                f"this replica has been refusing most new calls: a retry here would only take another call's place;"
                f" a slot frees in {hint} ms ({go})"
            )
        if self.saturated:
            return (
                f"this replica has been refusing most new calls and can promise a retry no slot inside this budget;"
                f" a slot frees in {hint} ms ({go})"
            )
        if not self.within_budget:
            return f"no retry fits inside this budget with room to spare; this replica frees up in {hint} ms ({go})"
        if self.reserved:
            return f"retry in {hint} ms: {held} from then"
        if holds_nothing:
            return f"retry in {hint} ms is a best guess: nothing is held for it (kept headroom is never reserved)"
        return f"retry in {hint} ms is a best guess: nothing is held for it (every reservation is taken)"

    @property
    def pushback_ms(self) -> int:
        """grpc-retry-pushback-ms. gRFC A6 clients sleep a positive pushback even past the call's deadline, so a
        hint that does not fit the remaining time says -1 (do not retry): the app hears the refusal at once.
        An unbacked hint that fits is still a positive pushback: a best guess beats a refusal the app can do
        nothing with but wait the same time, and a retry that misses is refused in a millisecond (with a -1 once
        no hint fits)."""
        return self.retry_after_ms if self.within_budget else -1


# What a reservation holds, where it is not a slot alone.
_HELD = {
    RefusalCause.STEP_BUDGET: "its turn is held",
    RefusalCause.KV_BLOCKS: "a slot and its KV blocks are reserved for it",
}
# Causes whose refusal never reserves: the room it was refused is kept for others.
_HOLDS_NOTHING = frozenset({RefusalCause.OVER_SHARE, RefusalCause.PRIORITY})
_WHY = {
    RefusalCause.SLOTS_FULL: "slots full: every slot is taken, by running calls or reserved retries, at some point "
    "of its predicted run ({finish} ms of a {budget} ms budget)",
    RefusalCause.STEP_BUDGET: "the next engine steps' token budget is taken by prompts ahead of it (its run would "
    "end in {finish} ms of a {budget} ms budget)",
    RefusalCause.DEADLINE: "predicted finish in {finish} ms exceeds the budget of {budget} ms, less the safety "
    "margin, under the current load",
    RefusalCause.DELAYS_ADMITTED: "joining now would push an admitted call past its deadline (its own predicted "
    "finish, {finish} ms, fits the budget of {budget} ms)",
    RefusalCause.OVER_SHARE: "your tenant holds its fair share of this replica's slots or more, and the free ones "
    "are kept for tenants under theirs (its run would end in {finish} ms of a {budget} ms budget)",
    RefusalCause.PRIORITY: "what is free on this replica is headroom kept for a higher-priority class of service "
    "that is active (its run would end in {finish} ms of a {budget} ms budget)",
    RefusalCause.KV_BLOCKS: "the KV cache lacks the blocks for its prompt and max_tokens until running calls end "
    "(its run would end in {finish} ms of a {budget} ms budget)",
    RefusalCause.COMPILES: "the replica is compiling as many new response_format grammars as it compiles at once "
    "(a {budget} ms budget)",
}


class QuotaExceeded(ServiceError):
    """The tenant is at one of its caps (billing/policy.py): a monthly one (device time or spend, until the month
    resets) or its calls per second on this replica. Nothing was admitted, nothing is billed. `retry_after_ms`
    is when the cap lifts; a hint at or past the call's budget says -1 as its pushback (do not retry)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "QUOTA_EXCEEDED"

    def __init__(
        self, tenant: str, cap: str, limit: int, used: int, retry_after_ms: int, budget_ms: int, resets_at_us: int = 0
    ) -> None:
        self.subject = f"tenant:{tenant}"
        self.description = f"{cap}: {used} of {limit} used"
        self.retry_after_ms = max(retry_after_ms, 0)
        self.within_budget = self.retry_after_ms < budget_ms
        when = "the next call is allowed" if resets_at_us == 0 else "the cap resets"
        then = "" if self.within_budget else f", past this call's budget of {budget_ms} ms (do not retry it)"
        metadata = {"cap": cap, "limit": str(limit), "used": str(used), "retry_after_ms": str(self.retry_after_ms)}
        if resets_at_us:
            metadata["resets_at_us"] = str(resets_at_us)
        super().__init__(
            f"tenant {tenant!r} is at its quota ({self.description}); {when} in {self.retry_after_ms} ms{then}",
            metadata,
        )

    @property
    def pushback_ms(self) -> int:
        """grpc-retry-pushback-ms: the hint when it fits the call's remaining time, else -1 (do not retry)."""
        return self.retry_after_ms if self.within_budget else -1


class ServiceClassRefused(InvalidArgument):
    """The call's class of service is unknown, or does not accept its budget; or, with no class named, no class
    accepts its budget. Names the field (service_class, or deadline) and the classes' budget ranges."""

    def __init__(self, field: str, description: str, reason: str, metadata: dict[str, str]) -> None:
        super().__init__([FieldViolation(field, description)])
        self.reason = reason
        self.metadata = metadata


class GrammarFailed(InvalidArgument):
    """The call's response_format grammar went past its per-token limits while the call ran (grammar.py
    GrammarLimits: a grammar whose next-token mask costs too much to compute). The call ended there, alone, and is
    billed for what ran; the same response_format will fail the same way."""

    reason = "GRAMMAR_LIMITS"

    def __init__(self, field: str, description: str) -> None:
        super().__init__([FieldViolation(field, description)])


class DeadlineInfeasible(ServiceError):
    """Even an idle server could not finish inside the budget: retrying with it is pointless. `compile_ms`: the
    call's response_format alone takes about this long to compile (server and engine), longer than its budget
    allows; the minimum budget is then at least that (its run comes on top). `still_compiling`: the compile that ran
    out of the budget goes on, and later calls with the same response_format find it compiled."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_INFEASIBLE"

    def __init__(
        self, budget_ms: int, min_budget_ms: int, compile_ms: int | None = None, still_compiling: bool = False
    ) -> None:
        metadata = {"min_budget_ms": str(min_budget_ms), "budget_ms": str(budget_ms)}
        if compile_ms is None:
            why = f"the minimum feasible budget is {min_budget_ms} ms"
        else:
            metadata["compile_ms"] = str(compile_ms)
            why = (
                f"compiling its response_format takes about {compile_ms} ms, so the minimum feasible budget is "
                f"more than {min_budget_ms} ms"
            ) + (
                "; the compile goes on, and calls with the same response_format will find it compiled"
                if still_compiling
                else ""
            )
        super().__init__(f"a budget of {budget_ms} ms cannot be met even on an idle server; {why}", metadata)


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


class DeviceFailed(ServiceError):
    """The replica's device stopped answering (health/watchdog.py): new calls and the calls it was running go
    elsewhere; the calls are billed for what ran."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "DEVICE_FAILED"


class RequestIdInUse(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "REQUEST_ID_IN_USE"


class EngineFailure(ServiceError):
    code = grpc.StatusCode.INTERNAL
    reason = "ENGINE_FAILURE"


# The ledger database refused or dropped the connection, or a transaction lost a lock race: nothing was committed,
# and the same call may be retried. A billing error (billing.db.ledger_errors makes it from SQLAlchemy's), mapped
# to UNAVAILABLE (services/status.py) like every billing.Unavailable.
LedgerUnavailable = billing.LedgerUnavailable


class UsageNotRecorded(ServiceError):
    """The request ran but its usage record could not be made durable; it is not reported as done."""

    code = grpc.StatusCode.INTERNAL
    reason = "USAGE_NOT_RECORDED"


class AuthUnavailable(ServiceError):
    """The service that checks API keys could not be asked; the key is neither accepted nor refused."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "AUTH_UNAVAILABLE"
