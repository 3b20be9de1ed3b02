"""One Generate call's bookkeeping, shared by the sync and asyncio transports: the request, each attempt's
metadata and timeout, the retrier's verdict on a failure, and the report. The transports only do the I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import grpc
from zeroqueue.inference.v1 import inference_pb2 as pb

from .errors import ZeroQueueError, error_for
from .failure import Failure
from .results import Admission, AttemptRecord, CallReport, Chunk, Result, admission_from, chunk_from, result_from
from .retry import CallState, GiveUp, Retrier, Retry

RETRY_ATTEMPT_KEY = "x-retry-attempt"


@dataclass(frozen=True)
class Attempt:
    endpoint: int
    request: pb.GenerateRequest
    timeout_s: float
    metadata: tuple[tuple[str, str], ...]


class CallDriver:
    def __init__(
        self, retrier: Retrier, endpoints: Sequence[str], api_key: str, request: pb.GenerateRequest, deadline_ms: float
    ) -> None:
        self.retrier = retrier
        self.endpoints = endpoints
        self.auth = ("authorization", f"Bearer {api_key}")
        self.request = request
        self.state: CallState = retrier.start(deadline_ms, request.model)
        self.records: list[AttemptRecord] = []
        self.next = Retry(retrier.first_endpoint(), 0.0, "")
        self.gave_up = ""
        self.last_overload: Failure | None = None
        self.admission: Admission | None = None
        self.chunks: list[Chunk] = []
        self.num_tokens = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def delay_s(self) -> float:
        """How long to sleep before the next attempt."""
        return self.next.delay_s

    def begin(self) -> Attempt:
        """The next attempt, its timeout being whatever budget the call has left right now."""
        number = self.state.num_attempts
        self.state.num_attempts += 1
        request = self.request
        if self.state.model != request.model:
            request = pb.GenerateRequest()
            request.CopyFrom(self.request)
            request.model = self.state.model
        timeout_s = max(self.retrier.remaining_s(self.state), 0.0)
        metadata = (self.auth,) if number == 0 else (self.auth, (RETRY_ATTEMPT_KEY, str(number)))
        self.records.append(
            AttemptRecord(
                number,
                self.endpoints[self.next.endpoint],
                self.state.model,
                self._since_start(),
                timeout_s,
                self.next.delay_s,
                self.next.reason,
            )
        )
        return Attempt(self.next.endpoint, request, timeout_s, metadata)

    def failed(self, attempt: Attempt, failure: Failure) -> ZeroQueueError | None:
        """Records a failed attempt; returns the error to raise, or None to go on with `self.next`."""
        self._settle(failure.code.name, failure.reason, failure.retry_after_ms)
        decision = self.retrier.after_failure(self.state, attempt.endpoint, failure)
        if isinstance(decision, GiveUp):
            self.gave_up = decision.why
            return error_for(self._told(failure), self.report())
        if failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.last_overload = failure
        self.next = decision
        return None

    def _told(self, failure: Failure) -> Failure:
        """What the caller hears. A budget that ran short only because earlier tries were refused as
        OVERLOADED (a retry found DEADLINE_INFEASIBLE, or expired before its answer) means the replicas were
        overloaded, not that the caller's deadline was too small: it is reported as that rejection."""
        if failure.code == grpc.StatusCode.DEADLINE_EXCEEDED and not failure.after_admission and self.last_overload:
            self.gave_up = "deadline"
            return self.last_overload
        return failure

    def admitted(self, attempt: Attempt, message: pb.GenerateResponse) -> None:
        self._settle("admitted")
        self.retrier.on_admitted(attempt.endpoint)
        self.admission = admission_from(message.admission, self.endpoints[attempt.endpoint])

    def chunk(self, message: pb.TokenChunk) -> Chunk:
        chunk = chunk_from(message)
        self.chunks.append(chunk)
        self.num_tokens += len(chunk.token_ids)
        return chunk

    def result(self, final: pb.Final) -> Result:
        return result_from(final, self.admission, self.chunks, self.report())

    def report(self) -> CallReport:
        return CallReport(self.request_id, tuple(self.records), self._since_start(), self.gave_up)

    def _settle(self, outcome: str, reason: str = "", retry_after_ms: int | None = None) -> None:
        self.records[-1] = replace(self.records[-1], outcome=outcome, reason=reason, retry_after_ms=retry_after_ms)

    def _since_start(self) -> float:
        return self.retrier.clock() - self.state.started_s

    def protocol_error(self, what: str) -> ZeroQueueError:
        """The stream broke the contract (no admission first, no final last): a server bug, never retried."""
        self.gave_up = "protocol"
        failure = Failure(
            grpc.StatusCode.INTERNAL,
            f"protocol error: {what}",
            reason="PROTOCOL",
            after_admission=self.admission is not None,
            num_tokens_delivered=self.num_tokens,
        )
        if self.records and self.records[-1].outcome == "pending":
            self._settle("INTERNAL", "PROTOCOL")
        return error_for(failure, self.report())
