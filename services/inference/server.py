"""gRPC handlers: protobuf in, validated domain objects to the service, protobuf out. Nothing else here
converts between the two, and every refusal goes through services/errors.py."""
from __future__ import annotations

import math
import re
import secrets
import time
import uuid
from dataclasses import dataclass
from types import MappingProxyType

import grpc
from tokenizers import Tokenizer

from billing.errors import InvalidRecord, PermissionDenied
from billing.records import freeze_labels
from services import errors
from services.auth import Authenticator, bearer_key
from services.errors import FieldViolation, rpc_errors
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc
from .request import SamplingParams
from .service import BudgetSource, GenerateSpec, InferenceService, Ticket, WarmupState

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
_STATE = {WarmupState.WARMING_UP: pb.WARMUP_STATE_WARMING_UP, WarmupState.READY: pb.WARMUP_STATE_READY,
          WarmupState.DRAINING: pb.WARMUP_STATE_DRAINING, WarmupState.FAILED: pb.WARMUP_STATE_FAILED}
_SOURCE = {BudgetSource.CLIENT_DEADLINE: pb.BUDGET_SOURCE_CLIENT_DEADLINE,
           BudgetSource.SERVER_DEFAULT: pb.BUDGET_SOURCE_SERVER_DEFAULT}


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_bytes: int = 1 << 20
    max_stop_strings: int = 8
    max_stop_chars: int = 64


class _Violations:
    def __init__(self) -> None:
        self.items: list[FieldViolation] = []
        self.out_of_range = False

    def add(self, field: str, description: str, out_of_range: bool = False) -> None:
        self.items.append(FieldViolation(field, description))
        self.out_of_range = self.out_of_range or out_of_range

    def raise_if_any(self) -> None:
        if self.items:
            # OUT_OF_RANGE only when every problem is a size that exceeds a limit the caller could fit
            code = grpc.StatusCode.OUT_OF_RANGE if self.out_of_range and len(self.items) == 1 else None
            raise errors.InvalidArgument(self.items, code)


def _retry_attempt(metadata: tuple) -> int:
    """Retry number from our SDK's x-retry-attempt, or from gRPC's own retry policy."""
    attempts = [int(value) for key, value in metadata or ()
                if key in ("x-retry-attempt", "grpc-previous-rpc-attempts") and value.isdigit()]
    return max(attempts, default=0)


def _sampling(msg: pb.GenerateRequest, v: _Violations, limits: RequestLimits) -> SamplingParams:
    temperature = msg.temperature if msg.HasField("temperature") else 1.0
    top_p = msg.top_p if msg.HasField("top_p") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        v.add("temperature", f"must be a finite number >= 0, got {temperature}")
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        v.add("top_p", f"must be in (0, 1], got {top_p}")
    if msg.top_k < 0:
        v.add("top_k", f"must be >= 0 (0 disables top-k), got {msg.top_k}")
    if len(msg.stop) > limits.max_stop_strings:
        v.add("stop", f"at most {limits.max_stop_strings} stop strings, got {len(msg.stop)}")
    for i, s in enumerate(msg.stop):
        if not s or len(s) > limits.max_stop_chars:
            v.add(f"stop[{i}]", f"must be 1 to {limits.max_stop_chars} characters, got {len(s)}")
    seed = msg.seed if msg.HasField("seed") else secrets.randbits(63)
    return SamplingParams(max_tokens=max(msg.max_tokens, 1), temperature=temperature, top_p=top_p,
                          top_k=max(msg.top_k, 0), seed=seed, stop=tuple(msg.stop))


def _labels(msg: pb.GenerateRequest, v: _Violations) -> MappingProxyType:
    """The ledger's own label rules, checked at arrival so a usage record can never be refused later."""
    try:
        return freeze_labels(dict(msg.labels))
    except InvalidRecord as exc:
        v.add(exc.field or "labels", exc.message)
        return MappingProxyType({})


def _prompt(msg: pb.GenerateRequest, tokenizer: Tokenizer, vocab_size: int, context: int, v: _Violations,
            limits: RequestLimits) -> tuple[int, ...]:
    if msg.prompt and msg.prompt_token_ids:
        v.add("prompt_token_ids", "set prompt or prompt_token_ids, not both")
        return ()
    if msg.prompt_token_ids:
        bad = next((i for i, t in enumerate(msg.prompt_token_ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            v.add(f"prompt_token_ids[{bad}]",
                  f"token id {msg.prompt_token_ids[bad]} is outside the vocabulary [0, {vocab_size})")
        tokens = tuple(msg.prompt_token_ids)
    elif len(msg.prompt.encode()) > limits.max_prompt_bytes:
        v.add("prompt", f"at most {limits.max_prompt_bytes} bytes", out_of_range=True)
        return ()
    else:
        tokens = tuple(tokenizer.encode(msg.prompt).ids)
    if not tokens:
        v.add("prompt", "must not be empty (set prompt or prompt_token_ids)")
    elif len(tokens) >= context:
        v.add("prompt", f"{len(tokens)} tokens; the context holds {context}, so at most {context - 1}",
              out_of_range=True)
    return tokens


def to_spec(msg: pb.GenerateRequest, card, tokenizer: Tokenizer, limits: RequestLimits,
            metadata: tuple) -> GenerateSpec:
    """Validates a GenerateRequest; every problem found is reported together, each naming its field."""
    v = _Violations()
    if msg.model and msg.model != card.name:
        v.add("model", f"unknown model {msg.model!r}; this server serves {card.name!r}")
    if msg.request_id and not _REQUEST_ID.match(msg.request_id):
        v.add("request_id", "1 to 128 characters from A-Z a-z 0-9 . _ : -")
    tokens = _prompt(msg, tokenizer, card.vocab_size, card.context_length, v, limits)
    if msg.max_tokens <= 0:
        v.add("max_tokens", f"must be >= 1, got {msg.max_tokens}")
    elif tokens and len(tokens) < card.context_length < len(tokens) + msg.max_tokens:
        v.add("max_tokens", f"prompt ({len(tokens)} tokens) + max_tokens ({msg.max_tokens}) exceeds the context "
                            f"length {card.context_length}", out_of_range=True)
    sampling = _sampling(msg, v, limits)
    labels = _labels(msg, v)
    v.raise_if_any()
    return GenerateSpec(msg.request_id or uuid.uuid4().hex, tokens, sampling, labels,
                        _retry_attempt(metadata))


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """`service` stays None while the replica warms up; Generate then answers UNAVAILABLE."""

    def __init__(self, name: str, tokenizer: Tokenizer, authenticator: Authenticator,
                 limits: RequestLimits | None = None) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.authenticator = authenticator
        self.limits = limits or RequestLimits()
        self.service: InferenceService | None = None

    async def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The tenant billed for the call: the API key's, never a request field."""
        principal = await self.authenticator.authenticate(bearer_key(context.invocation_metadata()))
        if principal.tenant is None:
            raise PermissionDenied("Generate needs a tenant's API key: usage is billed to the key's tenant, "
                                   "and an admin key has none", field="authorization")
        return principal.tenant

    def _ready_service(self) -> InferenceService:
        if self.service is None:
            raise errors.NotServing("replica is warming up; try another replica", {"state": "warming_up"})
        return self.service

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        received_ns = time.monotonic_ns()
        ticket = None

        def time_refusal(code: grpc.StatusCode) -> None:
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED and self.service is not None:
                self.service.metrics.refusal_reply_time.observe((time.monotonic_ns() - received_ns) / 1e9)

        async with rpc_errors(context, "Generate", request.request_id, before_abort=time_refusal):
            tenant = await self._tenant(context)
            service = self._ready_service()
            spec = to_spec(request, service.card, self.tokenizer, self.limits, context.invocation_metadata())
            budget_ns, source = service.budget(context.time_remaining())
            ticket = service.submit(spec, tenant, received_ns, budget_ns, source)
        try:
            await context.send_initial_metadata((("x-budget-ms", str(ticket.budget_ms)),
                                                 ("x-budget-source", source.value)))
            yield pb.GenerateResponse(admission=self._admission(ticket))
            async with rpc_errors(context, "Generate", spec.request_id):
                async for output in self.service.stream(ticket):
                    if output.token_ids or output.text:
                        yield pb.GenerateResponse(chunk=pb.TokenChunk(
                            token_ids=output.token_ids, text=output.text,
                            emitted_at_us=self.service.clock.epoch_us(output.time_ns)))
                    if output.finish_reason is not None:
                        self._raise_if_failed(ticket)
                        yield pb.GenerateResponse(final=self._final(ticket))
        finally:
            if ticket is not None:
                self.service.close(ticket)

    def _raise_if_failed(self, ticket: Ticket) -> None:
        if ticket.finish_reason == "deadline_exceeded":
            raise errors.DeadlineMissed(f"the request ran out of its {ticket.budget_ms} ms budget after "
                                        f"{ticket.num_output_tokens} tokens; it is recorded as a deadline miss")
        if ticket.finish_reason == "error":
            raise errors.EngineFailure("the engine failed while running this request; it has been logged")

    def _admission(self, t: Ticket) -> pb.Admission:
        clock = self.service.clock
        return pb.Admission(request_id=t.spec.request_id, call_id=t.call_id,
                            received_at_us=clock.epoch_us(t.received_ns),
                            dispatched_at_us=clock.epoch_us(t.dispatched_ns),
                            predicted_finish_at_us=clock.epoch_us(t.predicted_finish_ns),
                            deadline_at_us=clock.epoch_us(t.deadline_ns), budget_ms=t.budget_ms,
                            budget_source=_SOURCE[t.budget_source], prompt_tokens=len(t.spec.prompt_token_ids))

    def _final(self, t: Ticket) -> pb.Final:
        clock = self.service.clock
        first_scheduled = t.first_scheduled_ns or t.received_ns
        first_token = t.first_token_ns or t.finished_ns
        received_us, scheduled_us = clock.epoch_us(t.received_ns), clock.epoch_us(first_scheduled)
        first_token_us, finished_us = clock.epoch_us(first_token), clock.epoch_us(t.finished_ns)
        timings = pb.Timings(received_at_us=received_us, first_scheduled_at_us=scheduled_us,
                             first_token_at_us=first_token_us, finished_at_us=finished_us,
                             queue_us=scheduled_us - received_us, ttft_us=first_token_us - received_us,
                             total_us=finished_us - received_us, deadline_met=t.deadline_met)
        device = self.service.card.device
        usage = pb.Usage(prompt_tokens=len(t.spec.prompt_token_ids), completion_tokens=t.num_output_tokens,
                         sm_us=t.usage.unit_us, unit=device.unit, device_kind=device.kind,
                         device_id=device.device_id, num_compute_units=device.num_compute_units)
        return pb.Final(finish_reason=_FINISH[t.finish_reason], timings=timings, usage=usage)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
        async with rpc_errors(context, "ListModels"):
            await self.authenticator.authenticate(bearer_key(context.invocation_metadata()))
            if self.service is None:
                return pb.ListModelsResponse(models=[pb.ModelInfo(name=self.name,
                                                                  state=pb.WARMUP_STATE_WARMING_UP)])
            card = self.service.card
            return pb.ListModelsResponse(models=[pb.ModelInfo(
                name=card.name, context_length=card.context_length, dtype=card.dtype, device_kind=card.device.kind,
                device_name=card.device.name, num_compute_units=card.device.num_compute_units,
                unit=card.device.unit, state=_STATE[self.service.state], max_batch=card.max_batch,
                vocab_size=card.vocab_size)])
