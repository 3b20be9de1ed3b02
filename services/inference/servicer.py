"""gRPC handlers: protobuf in (a Generate request through generate_request.py), validated domain objects to the service,
protobuf out. Nothing else converts between the two, and every refusal goes through services/errors.py."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog
from tokenizers import Tokenizer
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc

from billing.errors import PermissionDenied
from billing.policy import STANDARD, ServingPolicy
from billing.records import Door
from services import errors, parsing
from services.auth import Authenticator, bearer_key
from services.errors import clip
from services.status import rpc_errors

from .admission import RefusalCause
from .call import BudgetSource, GenerateSpec, Ticket
from .card import WarmupState
from .chat import ChatMessage, ChatTemplate
from .compiler import CompilesBusy, CompileTooSlow, GrammarCompiler
from .generate_request import RequestLimits, encode, to_spec
from .grammar import Constraint, ConstraintKind, GrammarError, make_constraint
from .health.state import DeviceState
from .policy import PolicyBook, class_of
from .sched.request import FinishReason
from .service import InferenceService


def caller_budget_s(time_remaining_s: float | None) -> float | None:
    """The caller's budget from this server's view of its gRPC deadline (None: it set none). gRPC's core library
    (the Python, C++, Ruby and PHP clients) sends a deadline as a timeout rounded up to a unit of 1 ms below 1 s,
    10 ms below 10 s, 100 ms below 100 s and coarser beyond (its timeout_encoding.cc): a 2-s deadline arrives
    here as 2.009 s. A call planned on that would be on time by our clock and late by its caller's, so the budget
    is what remains less one unit, when the caller's own timer may fire. A client that rounds finer (grpc-js to
    1 ms, grpc-go to 1 µs) loses at most that unit of its budget."""
    if time_remaining_s is None:
        return None
    if time_remaining_s < 1:
        unit_s = 0.001
    elif time_remaining_s < 10:
        unit_s = 0.01
    elif time_remaining_s < 100:
        unit_s = 0.1
    else:
        unit_s = time_remaining_s / 100  # seconds and coarser units: at most 1 % of what remains
    return time_remaining_s - unit_s if time_remaining_s > unit_s else time_remaining_s


_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}
_STATE = {
    WarmupState.WARMING_UP: pb.WARMUP_STATE_WARMING_UP,
    WarmupState.READY: pb.WARMUP_STATE_READY,
    WarmupState.DRAINING: pb.WARMUP_STATE_DRAINING,
    WarmupState.FAILED: pb.WARMUP_STATE_FAILED,
}
_DEVICE_STATE = {
    DeviceState.HEALTHY: pb.DEVICE_STATE_HEALTHY,
    DeviceState.SLOW: pb.DEVICE_STATE_SLOW,
    DeviceState.FAILED: pb.DEVICE_STATE_FAILED,
}
_SOURCE = {
    BudgetSource.CLIENT_DEADLINE: pb.BUDGET_SOURCE_CLIENT_DEADLINE,
    BudgetSource.SERVER_DEFAULT: pb.BUDGET_SOURCE_SERVER_DEFAULT,
}
INFERENCE = pb.DESCRIPTOR.services_by_name["Inference"]


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """`service` stays None while the replica warms up; Generate then answers UNAVAILABLE. `book` holds the serving
    policy (classes of service, prices, quotas) the replica read last; without one, ServingPolicy(). `chat` is the
    model's chat template (None: messages are refused) and `compiler` the grammar compiler, set once warm (until
    then, as without one, a response_format is refused). It is generate_request.py's `Preparer`."""

    def __init__(
        self,
        name: str,
        tokenizer: Tokenizer,
        authenticator: Authenticator,
        limits: RequestLimits | None = None,
        book: PolicyBook | None = None,
        chat: ChatTemplate | None = None,
        chat_stop_token_ids: frozenset[int] = frozenset(),
        elsewhere: bool = False,
    ) -> None:
        self.name = name
        self.book = book or PolicyBook()
        self.tokenizer = tokenizer
        self.authenticator = authenticator
        self.limits = limits or RequestLimits()
        self.chat = chat
        self.chat_stop_token_ids = chat_stop_token_ids  # the template's end of turn ends a chat call
        self.elsewhere = elsewhere  # other replicas serve this model (serve --elsewhere): a refusal may point there
        self.compiler: GrammarCompiler | None = None
        self.formats_off = "this replica serves no response_format"  # why, while compiler is None
        self.service: InferenceService | None = None
        self._tokenize_pool = ThreadPoolExecutor(self.limits.tokenize_threads, thread_name_prefix="tokenize")

    def add_to_server(self, server: grpc.aio.Server, context_length: int) -> None:
        """Registers Inference on `server`; requests are parsed in the handlers (services/parsing.py), and one
        larger than any valid request for `context_length` is refused before parsing."""
        parsing.add_servicer(server, INFERENCE, self, self.limits.max_request_bytes(context_length))

    # ---- generate_request.Preparer ----
    @property
    def has_chat_template(self) -> bool:
        return self.chat is not None

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        if len(text) <= self.limits.inline_tokenize_chars:
            return tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        return await self._off_loop(encode, self.tokenizer, text, add_special_tokens)

    async def render(self, messages: list[ChatMessage]) -> str:
        assert self.chat is not None  # to_spec refuses messages without a template
        max_chars = self.limits.prompt_bytes(self._ready_service().card.context_length)
        if sum(len(m.content) for m in messages) <= self.limits.inline_tokenize_chars:
            return self.chat.render(messages, True, max_chars)
        return await self._off_loop(self.chat.render, messages, True, max_chars)

    async def constraint(self, kind: ConstraintKind, source: str) -> Constraint:
        if self.compiler is None:
            raise GrammarError(self.formats_off)
        if len(source) <= self.limits.inline_tokenize_chars:
            return make_constraint(kind, source, self.compiler.limits)
        return await self._off_loop(make_constraint, kind, source, self.compiler.limits)

    async def _off_loop(self, work, *args):
        """work(*args) on the tokenize pool: a long prompt's, conversation's or schema's, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, work, *args)

    async def _compile(self, spec: GenerateSpec, budget_ns: int, tenant: str, klass: str) -> int:
        """The call's constraint compiled (or found cached) inside its budget: the µs its compile took (0: cached,
        or none); or the refusal that says why not."""
        constraint = spec.sampling.constraint
        if constraint is None or budget_ns <= 0:  # no budget left: submit says DEADLINE_EXPIRED
            return 0
        try:
            return await self.compiler.prepare(constraint, budget_ns)
        except GrammarError as exc:
            raise errors.InvalidArgument(
                [errors.FieldViolation(f"response_format.{constraint.kind}", str(exc))]
            ) from None
        except CompileTooSlow as exc:
            self.service.metrics.count_refusal(RefusalCause.INFEASIBLE, tenant, klass)
            raise errors.DeadlineInfeasible(
                _ms(budget_ns), exc.compile_ms, exc.compile_ms, exc.still_compiling
            ) from None
        except CompilesBusy as exc:
            self.service.metrics.count_refusal(RefusalCause.COMPILES, tenant, klass)
            raise errors.Overloaded(
                exc.retry_after_ms,
                exc.retry_after_ms,
                _ms(budget_ns),
                cause=RefusalCause.COMPILES,
                elsewhere=self.elsewhere,
            ) from None

    async def _tenant(self, metadata: tuple) -> str:
        """The tenant billed for the call: the API key's, never a request field."""
        principal = await self.authenticator.authenticate(bearer_key(metadata))
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

    async def admit(
        self,
        request: pb.GenerateRequest,
        metadata: tuple,
        budget_s: float | None,
        source: BudgetSource,
        received_ns: int,
        door: Door = Door.GRPC,
    ) -> Ticket:
        """One call through either door: authenticated, validated, classed, compiled and admitted, or the domain
        error that says why not. `budget_s`: what the caller allows (None: the server's default) and `source`
        where that came from. The caller streams the ticket (`self.service.stream`, then `check_finished`)
        and closes it (`self.service.close`) however its call ends."""
        tenant = await self._tenant(metadata)
        service = self._ready_service()
        spec = await to_spec(request, service.card, self.limits, metadata, self, door)
        budget_ns, source = service.budget(budget_s, source)
        policy = self.book.policy  # an expired budget has no class: submit says DEADLINE_EXPIRED
        klass = STANDARD if budget_ns <= 0 else class_of(policy, spec.service_class, _ms(budget_ns), source)
        # every later line of this call says who and in which class (each call is a task: its own context)
        structlog.contextvars.bind_contextvars(tenant=tenant, service_class=klass.name)
        compile_us = await self._compile(spec, received_ns + budget_ns - time.monotonic_ns(), tenant, klass.name)
        # the engine compiles its own copy before the call's first step: as long as the server's took
        ticket = service.submit(spec, tenant, received_ns, budget_ns, source, klass, lead_ns=compile_us * 1000)
        ticket.compile_us = compile_us
        return ticket

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        received_ns = time.monotonic_ns()
        ticket = None

        def time_refusal(code: grpc.StatusCode) -> None:
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED and self.service is not None:
                self.service.metrics.refusal_reply_time.observe((time.monotonic_ns() - received_ns) / 1e9)

        async with rpc_errors(context, "Generate", clip(request.request_id, 128), before_abort=time_refusal):
            metadata, budget_s = context.invocation_metadata(), caller_budget_s(context.time_remaining())
            ticket = await self.admit(request, metadata, budget_s, BudgetSource.CLIENT_DEADLINE, received_ns)

        def close_first(code: grpc.StatusCode) -> None:
            # the call's slot and KV blocks are back before its caller hears how it ended, as after a final reply
            nonlocal ticket
            self.service.close(ticket)
            ticket = None

        try:
            await context.send_initial_metadata(
                (("x-budget-ms", str(ticket.budget_ms)), ("x-budget-source", ticket.budget_source.value))
            )
            yield pb.GenerateResponse(admission=self._admission(ticket))
            async with rpc_errors(context, "Generate", ticket.spec.request_id, before_abort=close_first):
                async for output in self.service.stream(ticket):
                    if output.token_ids or output.text:
                        yield pb.GenerateResponse(
                            chunk=pb.TokenChunk(
                                token_ids=output.token_ids,
                                text=output.text,
                                emitted_at_us=self.service.clock.epoch_us(output.time_ns),
                                logprobs=_logprobs(output.token_ids, output.logprobs) if output.logprobs else (),
                            )
                        )
                    if output.finish_reason is not None:
                        self.check_finished(ticket)
                        yield pb.GenerateResponse(final=self._final(ticket))
        finally:
            if ticket is not None:
                self.service.close(ticket)

    def check_finished(self, ticket: Ticket) -> None:
        """Raises the domain error of a call whose stream ended other than by stop or length."""
        if ticket.device_failure is not None:
            raise errors.DeviceFailed(
                f"this replica's device stopped answering while running the request ({ticket.device_failure}); "
                f"it is billed for the {ticket.num_output_tokens} tokens made, and may be retried elsewhere"
            )
        if ticket.finish_reason == FinishReason.DEADLINE_EXCEEDED:
            raise errors.DeadlineMissed(
                f"the request ran out of its {ticket.budget_ms} ms budget after "
                f"{ticket.num_output_tokens} tokens; it is recorded as a deadline miss"
            )
        constraint = ticket.spec.sampling.constraint
        if ticket.finish_reason == FinishReason.GRAMMAR and constraint is not None:
            raise errors.GrammarFailed(
                f"response_format.{constraint.kind}",
                f"the grammar went past its per-token limits after {ticket.num_output_tokens} tokens; "
                "the call ended there and is billed for what ran",
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
            predicted_start_at_us=clock.epoch_us(t.predicted_start_ns or t.dispatched_ns),
            deadline_at_us=clock.epoch_us(t.deadline_ns),
            budget_ms=t.budget_ms,
            budget_source=_SOURCE[t.budget_source],
            prompt_tokens=len(t.spec.prompt_token_ids),
            service_class=t.service_class,
            compile_us=t.compile_us,
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
            cached_prompt_tokens=t.usage.cached_prompt_tokens,
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
                        device_state=_DEVICE_STATE[self.service.device_state],
                        classes=_offers(self.book.policy, card.name, card.device.unit),
                        has_chat_template=self.chat is not None,
                        response_formats=list(ConstraintKind) if self.compiler is not None else [],
                        kv_blocks=card.kv_blocks,
                        kv_block_size=card.kv_block_size,
                        prefix_cache=card.prefix_cache,
                        weight_dtype=card.weight_dtype or card.dtype,
                    )
                ]
            )


def _logprobs(token_ids: tuple[int, ...], logprobs: tuple[tuple, ...]) -> list[pb.TokenLogprob]:
    """The chunk's log-probabilities, one per token (none when the call did not ask)."""
    return [
        pb.TokenLogprob(token_id=t, logprob=lp, top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in top])
        for t, (lp, top) in zip(token_ids, logprobs)
    ]


def _ms(budget_ns: int) -> int:
    """A budget in whole ms, at least 1 (a call with under 1 ms left is judged by admission, not by its class)."""
    return max(budget_ns // 1_000_000, 1)


def _offers(policy: ServingPolicy, model: str, unit: str) -> list[pb.ClassOffer]:
    """Every class of service with what a call in it costs on this model, per unit·second (-1: no price set)."""
    offers = []
    for spec in policy.classes:
        quote = policy.price_of(model, unit, spec.name)
        offers.append(
            pb.ClassOffer(
                name=spec.name,
                min_budget_ms=spec.min_budget_ms,
                max_budget_ms=spec.max_budget_ms,
                priority=spec.priority,
                price_micros=quote.price_micros if quote is not None else -1,
                currency=quote.currency if quote is not None else "",
                credit_ppm=spec.credit_ppm,
            )
        )
    return offers
