"""gRPC handlers: protobuf in, validated domain objects to the service, protobuf out. Nothing else here
converts between the two, and every refusal goes through services/errors.py."""

from __future__ import annotations

import asyncio
import math
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType

import grpc
from tokenizers import Tokenizer
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc

from billing.errors import InvalidRecord, PermissionDenied
from billing.records import MAX_LABEL_KEY_CHARS, MAX_LABEL_VALUE_CHARS, MAX_LABELS, freeze_labels
from services import errors, parsing
from services.auth import Authenticator, bearer_key
from services.errors import FieldViolation, clip
from services.status import rpc_errors

from .sched.request import FinishReason, SamplingParams
from .service import BudgetSource, GenerateSpec, InferenceService, ModelCard, Ticket, WarmupState

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_ATTEMPT = re.compile(r"[0-9]{1,6}")
_ATTEMPT_HEADERS = ("x-retry-attempt", "grpc-previous-rpc-attempts")
_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}
_STATE = {
    WarmupState.WARMING_UP: pb.WARMUP_STATE_WARMING_UP,
    WarmupState.READY: pb.WARMUP_STATE_READY,
    WarmupState.DRAINING: pb.WARMUP_STATE_DRAINING,
    WarmupState.FAILED: pb.WARMUP_STATE_FAILED,
}
_SOURCE = {
    BudgetSource.CLIENT_DEADLINE: pb.BUDGET_SOURCE_CLIENT_DEADLINE,
    BudgetSource.SERVER_DEFAULT: pb.BUDGET_SOURCE_SERVER_DEFAULT,
}
INFERENCE = pb.DESCRIPTOR.services_by_name["Inference"]
_TOKEN_ID_BYTES = 8  # a token id on the wire: a varint of at most 5 bytes, and a tag when not packed
_SMALL_FIELDS_BYTES = 64 << 10  # every other field of a valid request together (stop strings, labels, ids: ~12 KiB)


@dataclass(frozen=True)
class RequestLimits:
    """What one Generate request may hold. Sizes are checked before anything costs: the request's bytes before
    it is parsed (`max_request_bytes`), then the prompt's bytes and token count before it is tokenized or copied."""

    max_prompt_bytes: int = 1 << 20  # whatever the context
    max_bytes_per_token: int = 32  # a text prompt over context × this many bytes cannot fit the context
    max_stop_strings: int = 8
    max_stop_chars: int = 64
    inline_tokenize_chars: int = 1024  # longer prompts are tokenized on a worker thread (~1 ms/KiB)
    tokenize_threads: int = 2
    min_temperature: float = 1e-4  # a temperature in (0, this) samples as greedy, its limit

    def prompt_bytes(self, context_length: int) -> int:
        return min(self.max_prompt_bytes, context_length * self.max_bytes_per_token)

    def max_request_bytes(self, context_length: int) -> int:
        """No valid GenerateRequest is larger: a full prompt or a context of token ids, and the small fields."""
        return max(self.prompt_bytes(context_length), context_length * _TOKEN_ID_BYTES) + _SMALL_FIELDS_BYTES


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


def _retry_attempt(metadata: tuple, v: _Violations) -> int:
    """Retry number from our SDK's x-retry-attempt, or from gRPC's own retry policy: at most 6 digits (a
    longer number is no retry count, and Python refuses to convert one of 4,300 digits)."""
    attempt = 0
    for key, value in metadata or ():
        if key not in _ATTEMPT_HEADERS:
            continue
        if isinstance(value, str) and _ATTEMPT.fullmatch(value):
            attempt = max(attempt, int(value))
        else:
            shown = clip(value if isinstance(value, str) else repr(value))
            v.add(key, f"must be a retry count of 1 to 6 digits 0-9, got {shown!r} ({len(value)} characters)")
    return attempt


def _sampling(msg: pb.GenerateRequest, v: _Violations, limits: RequestLimits) -> SamplingParams:
    temperature = msg.temperature if msg.HasField("temperature") else 1.0
    top_p = msg.top_p if msg.HasField("top_p") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        v.add("temperature", f"must be a finite number >= 0, got {temperature}")
    elif temperature < limits.min_temperature:
        # the limit of sampling as the temperature goes to 0 is greedy; dividing logits by a denormal is inf
        temperature = 0.0
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        v.add("top_p", f"must be in (0, 1], got {top_p}")
    if msg.top_k < 0:
        v.add("top_k", f"must be >= 0 (0 disables top-k), got {msg.top_k}")
    stop = msg.stop
    if len(stop) > limits.max_stop_strings:
        v.add("stop", f"at most {limits.max_stop_strings} stop strings, got {len(stop)}")
        stop = ()
    for i, s in enumerate(stop):
        if not s or len(s) > limits.max_stop_chars:
            v.add(f"stop[{i}]", f"must be 1 to {limits.max_stop_chars} characters, got {len(s)}")
    seed = msg.seed if msg.HasField("seed") else secrets.randbits(63)
    return SamplingParams(
        max_tokens=max(msg.max_tokens, 1),
        temperature=temperature,
        top_p=top_p,
        top_k=max(msg.top_k, 0),
        seed=seed,
        stop=tuple(stop),
    )


def _labels(msg: pb.GenerateRequest, v: _Violations) -> MappingProxyType:
    """The ledger's own label rules, checked at arrival so a usage record can never be refused later: sizes
    first, then each label on its own, so that every bad one is named (and echoed short)."""
    if len(msg.labels) > MAX_LABELS:
        v.add("labels", f"at most {MAX_LABELS} labels, got {len(msg.labels)}")
        return MappingProxyType({})
    labels, bad = dict(msg.labels), False
    for key, value in sorted(labels.items()):
        field = f"labels.{clip(key)}"
        if len(key) > MAX_LABEL_KEY_CHARS:
            v.add(field, f"a key is at most {MAX_LABEL_KEY_CHARS} characters, got {len(key)}")
        elif len(value) > MAX_LABEL_VALUE_CHARS:
            v.add(field, f"a value is at most {MAX_LABEL_VALUE_CHARS} characters, got {len(value)}")
        else:
            try:
                freeze_labels({key: value})
                continue
            except InvalidRecord as exc:
                v.add(field, clip(exc.message, 256))
        bad = True
    return MappingProxyType({}) if bad else freeze_labels(labels)


def _prompt(
    msg: pb.GenerateRequest, card: ModelCard, v: _Violations, limits: RequestLimits
) -> tuple[int, ...] | str | None:
    """The prompt's token ids, or its text to tokenize; None when it is wrong. Sizes come first: the number of
    ids before they are copied or scanned, the text's bytes before it is tokenized."""
    context, num_ids, text = card.context_length, len(msg.prompt_token_ids), msg.prompt
    if text and num_ids:
        v.add("prompt_token_ids", "set prompt or prompt_token_ids, not both")
        return None
    if num_ids:
        if num_ids >= context:
            v.add(
                "prompt_token_ids",
                f"{num_ids} tokens; the context holds {context}, so at most {context - 1}",
                out_of_range=True,
            )
            return None
        tokens = tuple(msg.prompt_token_ids)
        if min(tokens) < 0 or max(tokens) >= card.vocab_size:
            bad = next(i for i, t in enumerate(tokens) if not 0 <= t < card.vocab_size)
            v.add(
                f"prompt_token_ids[{bad}]", f"token id {tokens[bad]} is outside the vocabulary [0, {card.vocab_size})"
            )
            return None
        return tokens
    if not text:
        v.add("prompt", "must not be empty (set prompt or prompt_token_ids)")
        return None
    cap = limits.prompt_bytes(context)
    size = len(text.encode())  # at most the request's size, which is bounded before parsing
    if size > cap:
        v.add(
            "prompt",
            f"{size} bytes; at most {cap} for a context of {context} tokens (a text of longer tokens "
            f"fits as prompt_token_ids)",
            out_of_range=True,
        )
        return None
    return text


def _check_length(tokens: tuple[int, ...], field: str, max_tokens: int, context: int, v: _Violations) -> None:
    if not tokens:
        v.add(field, "must not be empty (set prompt or prompt_token_ids)")
    elif len(tokens) >= context:
        v.add(field, f"{len(tokens)} tokens; the context holds {context}, so at most {context - 1}", out_of_range=True)
    elif len(tokens) + max_tokens > context:
        v.add(
            "max_tokens",
            f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the context length {context}",
            out_of_range=True,
        )


async def to_spec(
    msg: pb.GenerateRequest,
    card: ModelCard,
    limits: RequestLimits,
    metadata: tuple,
    tokenize: Callable[[str], Awaitable[tuple[int, ...]]],
) -> GenerateSpec:
    """Validates a GenerateRequest. Every field first, by cheap checks that bound sizes before anything costs,
    all problems found reported together, each naming its field; only a request with none is tokenized (off
    the loop when long), and then its length checked against the context."""
    v = _Violations()
    if msg.model and msg.model != card.name:
        v.add("model", f"unknown model {clip(msg.model)!r}; this server serves {card.name!r}")
    if msg.request_id and not _REQUEST_ID.match(msg.request_id):
        v.add("request_id", "1 to 128 characters from A-Z a-z 0-9 . _ : -")
    prompt = _prompt(msg, card, v, limits)
    if msg.max_tokens <= 0:
        v.add("max_tokens", f"must be >= 1, got {msg.max_tokens}")
    elif msg.max_tokens >= card.context_length:
        v.add(
            "max_tokens",
            f"{msg.max_tokens} does not fit the context length {card.context_length} beside a prompt",
            out_of_range=True,
        )
    sampling = _sampling(msg, v, limits)
    labels = _labels(msg, v)
    attempt = _retry_attempt(metadata, v)
    v.raise_if_any()
    field = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    tokens = await tokenize(prompt) if isinstance(prompt, str) else prompt
    _check_length(tokens, field, msg.max_tokens, card.context_length, v)
    v.raise_if_any()
    return GenerateSpec(msg.request_id or uuid.uuid4().hex, tokens, sampling, labels, attempt)


def _encode(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    # encode_batch lets go of the GIL while it runs (encode does not): the event loop goes on meanwhile
    return tuple(tokenizer.encode_batch([text])[0].ids)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """`service` stays None while the replica warms up; Generate then answers UNAVAILABLE."""

    def __init__(
        self, name: str, tokenizer: Tokenizer, authenticator: Authenticator, limits: RequestLimits | None = None
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.authenticator = authenticator
        self.limits = limits or RequestLimits()
        self.service: InferenceService | None = None
        self._tokenize_pool = ThreadPoolExecutor(self.limits.tokenize_threads, thread_name_prefix="tokenize")

    def add_to_server(self, server: grpc.aio.Server, context_length: int) -> None:
        """Registers Inference on `server`; requests are parsed in the handlers (services/parsing.py), and one
        larger than any valid request for `context_length` is refused before parsing."""
        parsing.add_servicer(server, INFERENCE, self, self.limits.max_request_bytes(context_length))

    async def _tokenize(self, text: str) -> tuple[int, ...]:
        if len(text) <= self.limits.inline_tokenize_chars:
            return tuple(self.tokenizer.encode(text).ids)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, _encode, self.tokenizer, text)

    async def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The tenant billed for the call: the API key's, never a request field."""
        principal = await self.authenticator.authenticate(bearer_key(context.invocation_metadata()))
        if principal.tenant is None:
            raise PermissionDenied(
                "Generate needs a tenant's API key: usage is billed to the key's tenant, and an admin key has none",
                field="authorization",
            )
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

        async with rpc_errors(context, "Generate", clip(request.request_id, 128), before_abort=time_refusal):
            tenant = await self._tenant(context)
            service = self._ready_service()
            spec = await to_spec(request, service.card, self.limits, context.invocation_metadata(), self._tokenize)
            budget_ns, source = service.budget(context.time_remaining())
            ticket = service.submit(spec, tenant, received_ns, budget_ns, source)
        try:
            await context.send_initial_metadata(
                (("x-budget-ms", str(ticket.budget_ms)), ("x-budget-source", source.value))
            )
            yield pb.GenerateResponse(admission=self._admission(ticket))
            async with rpc_errors(context, "Generate", spec.request_id):
                async for output in self.service.stream(ticket):
                    if output.token_ids or output.text:
                        yield pb.GenerateResponse(
                            chunk=pb.TokenChunk(
                                token_ids=output.token_ids,
                                text=output.text,
                                emitted_at_us=self.service.clock.epoch_us(output.time_ns),
                            )
                        )
                    if output.finish_reason is not None:
                        self._raise_if_failed(ticket)
                        yield pb.GenerateResponse(final=self._final(ticket))
        finally:
            if ticket is not None:
                self.service.close(ticket)

    def _raise_if_failed(self, ticket: Ticket) -> None:
        if ticket.finish_reason == FinishReason.DEADLINE_EXCEEDED:
            raise errors.DeadlineMissed(
                f"the request ran out of its {ticket.budget_ms} ms budget after "
                f"{ticket.num_output_tokens} tokens; it is recorded as a deadline miss"
            )
        if ticket.finish_reason == FinishReason.ERROR:
            raise errors.EngineFailure("the engine failed while running this request; it has been logged")

    def _admission(self, t: Ticket) -> pb.Admission:
        clock = self.service.clock
        return pb.Admission(
            request_id=t.spec.request_id,
            call_id=t.call_id,
            received_at_us=clock.epoch_us(t.received_ns),
            dispatched_at_us=clock.epoch_us(t.dispatched_ns),
            predicted_finish_at_us=clock.epoch_us(t.predicted_finish_ns),
            deadline_at_us=clock.epoch_us(t.deadline_ns),
            budget_ms=t.budget_ms,
            budget_source=_SOURCE[t.budget_source],
            prompt_tokens=len(t.spec.prompt_token_ids),
        )

    def _final(self, t: Ticket) -> pb.Final:
        clock = self.service.clock
        first_scheduled = t.first_scheduled_ns or t.received_ns
        first_token = t.first_token_ns or t.finished_ns
        received_us, scheduled_us = clock.epoch_us(t.received_ns), clock.epoch_us(first_scheduled)
        first_token_us, finished_us = clock.epoch_us(first_token), clock.epoch_us(t.finished_ns)
        timings = pb.Timings(
            received_at_us=received_us,
            first_scheduled_at_us=scheduled_us,
            first_token_at_us=first_token_us,
            finished_at_us=finished_us,
            queue_us=scheduled_us - received_us,
            ttft_us=first_token_us - received_us,
            total_us=finished_us - received_us,
            deadline_met=t.deadline_met,
        )
        device = self.service.card.device
        usage = pb.Usage(
            prompt_tokens=len(t.spec.prompt_token_ids),
            completion_tokens=t.num_output_tokens,
            sm_us=t.usage.unit_us,
            unit=device.unit,
            device_kind=device.kind,
            device_id=device.device_id,
            num_compute_units=device.num_units,
        )
        return pb.Final(finish_reason=_FINISH[t.finish_reason], timings=timings, usage=usage)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
        async with rpc_errors(context, "ListModels"):
            await self.authenticator.authenticate(bearer_key(context.invocation_metadata()))
            if self.service is None:
                return pb.ListModelsResponse(models=[pb.ModelInfo(name=self.name, state=pb.WARMUP_STATE_WARMING_UP)])
            card = self.service.card
            return pb.ListModelsResponse(
                models=[
                    pb.ModelInfo(
                        name=card.name,
                        context_length=card.context_length,
                        dtype=card.dtype,
                        device_kind=card.device.kind,
                        device_name=card.device.name,
                        num_compute_units=card.device.num_units,
                        unit=card.device.unit,
                        state=_STATE[self.service.state],
                        max_batch=card.max_batch,
                        vocab_size=card.vocab_size,
                    )
                ]
            )
