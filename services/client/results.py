"""What a Generate call gives back: chunks, the final result, and the report of its attempts.

Protobuf becomes these plain dataclasses here and nowhere else in the SDK.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from zeroqueue.inference.v1 import inference_pb2 as pb

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class AttemptRecord:
    """One try of a call. Times are seconds since the call began, on the client's monotonic clock."""

    number: int  # 0 is the first try; it is what x-retry-attempt said
    endpoint: str
    model: str
    started_s: float
    timeout_s: float  # the gRPC deadline this attempt carried: the call's remaining budget
    waited_s: float  # slept before this attempt
    wait_reason: str  # "" (first), failover, hint, clock_skew, no_hint, unavailable, fallback_model
    outcome: str = "pending"  # admitted, or the status code name of its failure
    reason: str = ""  # ErrorInfo.reason of a failure
    retry_after_ms: int | None = None


@dataclass(frozen=True)
class CallReport:
    request_id: str
    attempts: tuple[AttemptRecord, ...]
    elapsed_s: float  # call start -> the report was made (its end, for a finished call)
    gave_up: str = ""  # why the SDK stopped retrying: not_retryable, deadline, max_attempts, ...

    @property
    def num_attempts(self) -> int:
        return len(self.attempts)

    @property
    def num_retries(self) -> int:
        return max(len(self.attempts) - 1, 0)

    @property
    def num_rejections(self) -> int:
        return sum(1 for a in self.attempts if a.outcome == "RESOURCE_EXHAUSTED")

    @property
    def waited_s(self) -> float:
        return sum(a.waited_s for a in self.attempts)

    @property
    def admitted_attempt(self) -> AttemptRecord | None:
        return next((a for a in self.attempts if a.outcome == "admitted"), None)

    @property
    def endpoint(self) -> str:
        return self.attempts[-1].endpoint if self.attempts else ""


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float  # natural log


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the distribution it was drawn from (after the response_format's
    mask and the temperature, before top-k and top-p), and the `top` most likely tokens there, most likely first."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: tuple[int, ...]
    emitted_at_us: int  # server clock
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, in order, when the call asked for logprobs


@dataclass(frozen=True)
class Admission:
    request_id: str
    endpoint: str
    received_at_us: int
    dispatched_at_us: int
    predicted_finish_at_us: int
    deadline_at_us: int
    budget_ms: int
    prompt_tokens: int
    call_id: str = ""  # the replica's id of this call: the ledger's key for its usage record
    service_class: str = ""  # the class of service the call runs and is billed in
    # when it is predicted to begin: its dispatch, or the slot the replica held it for inside its slack
    predicted_start_at_us: int = 0
    compile_us: int = 0  # the replica compiling the call's response_format before admitting it; 0: cached or none


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    device_us: int  # SM·µs on a GPU, core·µs on a CPU: see unit
    unit: str
    device_kind: str
    device_id: str
    num_compute_units: int


@dataclass(frozen=True)
class Timings:
    """Server clock, µs."""

    received_at_us: int
    first_scheduled_at_us: int
    first_token_at_us: int
    finished_at_us: int
    queue_us: int
    ttft_us: int
    total_us: int
    deadline_met: bool


class IncompleteOutput(ValueError):
    """The call did not end with finish_reason "stop" (max_tokens or the context cut it short), so its text is not
    the whole output its response_format asked for."""


@dataclass(frozen=True)
class Result:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # stop | length
    usage: Usage
    timings: Timings
    admission: Admission
    report: CallReport
    logprobs: tuple[TokenLogprob, ...] = ()  # every chunk's, in order: one per token id, when asked for

    def json(self) -> object:
        """The output parsed as JSON: what a call with a json_object or json_schema response_format returns.
        IncompleteOutput when the call was cut short (finish_reason "length"); json.JSONDecodeError when the text
        is not JSON (a call without a JSON response_format)."""
        if self.finish_reason != "stop":
            raise IncompleteOutput(
                f"the call ended with finish_reason {self.finish_reason!r}, not 'stop': its output was cut short "
                f"after {len(self.token_ids)} tokens (allow more max_tokens)"
            )
        return json.loads(self.text)


@dataclass(frozen=True)
class ClassOffer:
    name: str
    min_budget_ms: int  # the deadlines the class accepts
    max_budget_ms: int
    priority: int  # higher is admitted first under overload
    price_micros: int  # per unit·second (ModelInfo's unit); -1 when no price is set
    currency: str
    credit_ppm: int  # share of a missed call's charge credited, per million


@dataclass(frozen=True)
class ModelInfo:
    name: str
    context_length: int
    vocab_size: int
    max_batch: int
    device_kind: str
    ready: bool
    device_state: str = ""  # healthy, slow or failed: the replica's watchdog on its device ("" if not said)
    classes: tuple[ClassOffer, ...] = ()  # the classes of service a call may name, with their prices here
    has_chat_template: bool = False  # generate(messages=...) can be served
    response_formats: tuple[str, ...] = ()  # the response_format types served: json_object, json_schema, ...


def admission_from(msg: pb.Admission, endpoint: str) -> Admission:
    return Admission(
        msg.request_id,
        endpoint,
        msg.received_at_us,
        msg.dispatched_at_us,
        msg.predicted_finish_at_us,
        msg.deadline_at_us,
        msg.budget_ms,
        msg.prompt_tokens,
        msg.call_id,
        msg.service_class,
        msg.predicted_start_at_us,
        msg.compile_us,
    )


def _logprob(msg: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in msg.top))


def chunk_from(msg: pb.TokenChunk) -> Chunk:
    return Chunk(msg.text, tuple(msg.token_ids), msg.emitted_at_us, tuple(_logprob(lp) for lp in msg.logprobs))


def result_from(final: pb.Final, admission: Admission, chunks: list[Chunk], report: CallReport) -> Result:
    u, t = final.usage, final.timings
    usage = Usage(
        u.prompt_tokens, u.completion_tokens, u.sm_us, u.unit, u.device_kind, u.device_id, u.num_compute_units
    )
    timings = Timings(
        t.received_at_us,
        t.first_scheduled_at_us,
        t.first_token_at_us,
        t.finished_at_us,
        t.queue_us,
        t.ttft_us,
        t.total_us,
        t.deadline_met,
    )
    return Result(
        admission.request_id,
        "".join(c.text for c in chunks),
        tuple(i for c in chunks for i in c.token_ids),
        _FINISH.get(final.finish_reason, "unspecified"),
        usage,
        timings,
        admission,
        report,
        tuple(lp for c in chunks for lp in c.logprobs),
    )


_DEVICE_STATES = {pb.DEVICE_STATE_HEALTHY: "healthy", pb.DEVICE_STATE_SLOW: "slow", pb.DEVICE_STATE_FAILED: "failed"}


def _offer(c: pb.ClassOffer) -> ClassOffer:
    return ClassOffer(c.name, c.min_budget_ms, c.max_budget_ms, c.priority, c.price_micros, c.currency, c.credit_ppm)


def models_from(reply: pb.ListModelsResponse) -> list[ModelInfo]:
    return [
        ModelInfo(
            m.name,
            m.context_length,
            m.vocab_size,
            m.max_batch,
            m.device_kind,
            m.state == pb.WARMUP_STATE_READY,
            _DEVICE_STATES.get(m.device_state, ""),
            tuple(_offer(c) for c in m.classes),
            m.has_chat_template,
            tuple(m.response_formats),
        )
        for m in reply.models
    ]
