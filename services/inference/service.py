"""The inference service in domain terms: admission, the engine, streams and their outcomes.

servicer.py turns protobuf into a validated GenerateSpec and calls `submit`, then relays `stream`.
Everything here runs on the event loop thread; the engine runs in its own process (engine/core.py) or,
with --engine-thread, on a thread of this one.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import structlog

from billing.policy import STANDARD, ClassSpec
from billing.records import Outcome
from services import errors
from services.metering.outbox import Outbox

from .admission import Admission, Admit, Commitment, Infeasible, RefusalCause, Reject
from .call import BudgetSource, GenerateSpec, LoopSink, Ticket, admission_key
from .card import ModelCard, WarmupState
from .clock import Clock
from .engine.digest import EndedRequest
from .engine.engine import RequestOutput
from .engine.handle import EngineHandle
from .health.state import DeviceState
from .kv_pool import KvReservations
from .meter import OUTCOMES, Meter, RecordContext
from .metrics import ServiceMetrics, StepLog
from .policy import PrefixCachePolicy, QuotaGate
from .sched.request import FinishReason, Request, RequestStatus

log = structlog.get_logger(__name__)


def _attempt_label(attempt: int) -> str:
    return str(attempt) if attempt < 3 else "3+"


def _refusal(
    decision: Infeasible | Reject, now_ns: int, budget_ns: int, lead_ns: int
) -> errors.DeadlineInfeasible | errors.Overloaded:
    """The domain error that says why admission refused the call (`lead_ns`: the engine's time before its first
    step, which its budget must also cover)."""
    if isinstance(decision, Infeasible):
        return errors.DeadlineInfeasible(budget_ns // 1_000_000, decision.min_budget_ms + -(-lead_ns // 1_000_000))
    return errors.Overloaded(
        decision.retry_after_ms,
        (decision.predicted_finish_ns - now_ns) // 1_000_000,
        budget_ns // 1_000_000,
        decision.within_budget,
        decision.reason,
        decision.reserved,
        decision.saturated,
        decision.elsewhere,
    )


class InferenceService:
    def __init__(
        self,
        engine: EngineHandle,
        card: ModelCard,
        admission: Admission,
        metrics: ServiceMetrics,
        clock: Clock,
        meter: Meter,
        outbox: Outbox,
        steps: StepLog,
        default_budget_ms: int = 30_000,
        stream_interval_ms: int = 0,
        quotas: QuotaGate | None = None,
        prefix_cache: PrefixCachePolicy | None = None,
        kv: KvReservations | None = None,
    ) -> None:
        self.engine = engine
        self.prefix_cache = prefix_cache or PrefixCachePolicy()  # per tenant unless shared (policy/gate.py)
        self.kv = kv  # deadline admission reserves each call's KV blocks (kv_pool.py); None: the engine does
        self.quotas = quotas  # tenants' caps (policy/gate.py); None: none enforced
        self.meter = meter
        self.outbox = outbox
        self.card = card
        self.admission = admission
        self.metrics = metrics
        self.clock = clock
        self.steps = steps
        self.default_budget_ms = default_budget_ms
        self.stream_interval_ns = stream_interval_ms * 1_000_000  # 0: a message per engine step
        self.state = WarmupState.WARMING_UP
        self.device_state = DeviceState.HEALTHY  # the engine's watchdog says (health/watchdog.py)
        self.in_flight: dict[tuple[str, str], Ticket] = {}  # (tenant, request_id) -> its admitted call
        # admission key -> an admitted call held for a later start (`Admit.start_ns`): it reaches the engine then,
        # or sooner if admission says a slot freed early (`Admission.due`)
        self.held: dict[str, tuple[Ticket, LoopSink, asyncio.TimerHandle]] = {}
        # held calls past their start whose KV blocks the running calls have not given back yet (later than
        # predicted): each starts as soon as an ending call gives them back, first come first
        self.awaiting_blocks: dict[str, None] = {}
        self.drained = asyncio.Event()

    @property
    def deadline_mode(self) -> bool:
        return self.admission.predicts

    def budget(self, time_remaining_s: float | None, source: BudgetSource) -> tuple[int, BudgetSource]:
        """The call's budget in ns: what its caller allows (a gRPC deadline, an HTTP door's header: `source`),
        or the server default when it says nothing."""
        if time_remaining_s is None:
            return self.default_budget_ms * 1_000_000, BudgetSource.SERVER_DEFAULT
        return int(time_remaining_s * 1e9), source

    def submit(
        self,
        spec: GenerateSpec,
        tenant: str,
        received_ns: int,
        budget_ns: int,
        source: BudgetSource,
        service_class: ClassSpec = STANDARD,
        lead_ns: int = 0,
    ) -> Ticket:
        """Admits the call, in its class of service, into the next engine step, or raises the domain error that
        says why not. The tenant's quotas come before the cost model: a tenant at a cap is refused at once.
        `lead_ns`: what the engine spends on the call before its first step (its grammar's compile): the call
        must finish that much sooner."""
        klass = service_class.name
        self._check_door(spec, tenant, received_ns, budget_ns, klass)
        deadline_ns = received_ns + budget_ns
        salt = self.prefix_cache.salt(tenant, klass)
        commitment = self._commitment(spec, tenant, deadline_ns - lead_ns, service_class, salt)
        now_ns = self.clock.now_ns()
        decision = self.admission.decide(commitment, now_ns)
        decided_ns = self.clock.now_ns()
        self.metrics.admission_time.observe((decided_ns - received_ns) / 1e9)
        attempt = _attempt_label(spec.retry_attempt)
        if not isinstance(decision, Admit):
            infeasible = isinstance(decision, Infeasible)
            self._count_decision(attempt, "infeasible" if infeasible else "overloaded")
            cause = RefusalCause.INFEASIBLE if infeasible else decision.reason
            self.metrics.count_refusal(cause, tenant, klass)
            raise _refusal(decision, now_ns, budget_ns, lead_ns)
        request = Request(
            uuid.uuid4().hex,
            spec.prompt_token_ids,
            spec.sampling,
            arrival_ns=received_ns,
            deadline_ns=deadline_ns if self.deadline_mode else None,
            cache_salt=salt,
        )
        # a held call takes its blocks at its start where admission plans them (they may free only by then)
        blocks_later = decision.start_ns is not None and self.kv is not None and self.kv.planned
        if self.kv is not None and not blocks_later and not self.kv.reserve(request):  # running calls hold them yet
            self.admission.release(commitment.key)
            self._count_decision(attempt, "overloaded")
            self.metrics.count_refusal(RefusalCause.KV_BLOCKS, tenant, klass)
            raise self.kv.refusal(request, self.in_flight.values(), decision.predicted_finish_ns, now_ns, budget_ns)
        self._count_decision(attempt, "admitted")
        context = RecordContext(
            tenant, spec.labels, received_ns, decided_ns, deadline_ns, spec.request_id, klass, spec.kind, spec.door
        )
        return self._admitted(spec, context, request, decision, budget_ns, source)

    def _check_door(self, spec: GenerateSpec, tenant: str, received_ns: int, budget_ns: int, klass: str) -> None:
        """What refuses a call before any prediction: a replica not serving, a failed device, the tenant's own id
        still in flight, a deadline already past, a quota at its cap."""
        if self.state is not WarmupState.READY:
            raise errors.NotServing(f"replica is {self.state.value}; try another replica", {"state": self.state.value})
        if self.device_state is DeviceState.FAILED:
            raise errors.DeviceFailed("this replica's device is not responding; try another replica")
        if (tenant, spec.request_id) in self.in_flight:  # only the tenant's own ids: no one else's is seen
            raise errors.RequestIdInUse(
                f"request_id {spec.request_id!r} is already in flight", {"request_id": spec.request_id}
            )
        if budget_ns <= 0:
            self.metrics.rejections.labels("deadline_expired").inc()
            raise errors.DeadlineExpired("the call's deadline had already passed when it arrived")
        if self.quotas is not None:
            try:
                self.quotas.check(tenant, received_ns, budget_ns)
            except errors.QuotaExceeded:
                self._count_decision(_attempt_label(spec.retry_attempt), "quota")
                self.metrics.count_refusal(RefusalCause.QUOTA, tenant, klass)
                raise

    def _commitment(
        self, spec: GenerateSpec, tenant: str, deadline_ns: int, service_class: ClassSpec, salt: str
    ) -> Commitment:
        """The call as admission judges it: its sizes, the deadline it must finish by (less the engine's lead), its
        class, and the prefix the KV pool holds for it with the blocks it would take."""
        num_cached, num_blocks = 0, 0
        if self.kv is not None:
            num_cached, num_blocks = self.kv.lookup(spec.prompt_token_ids, spec.sampling.max_tokens, salt)
        return Commitment(
            admission_key(tenant, spec.request_id),
            len(spec.prompt_token_ids),
            spec.sampling.max_tokens,
            deadline_ns,
            tenant=tenant,
            attempt=spec.retry_attempt,
            priority=service_class.priority,
            masked=spec.sampling.constraint is not None,
            logprobs=spec.sampling.logprobs,
            num_cached_tokens=num_cached,
            num_blocks=num_blocks if self.kv is not None and self.kv.planned else 0,
        )

    def _admitted(
        self,
        spec: GenerateSpec,
        context: RecordContext,
        request: Request,
        decision: Admit,
        budget_ns: int,
        source: BudgetSource,
    ) -> Ticket:
        """The admitted call's ticket, in flight and on the meter: handed to the engine now, or held for the start
        admission planned for it."""
        sink = LoopSink(asyncio.get_running_loop())
        # a planned start the decision itself outlasted is a start at the dispatch, never one before it
        start_ns = None if decision.start_ns is None else max(decision.start_ns, context.dispatched_ns)
        ticket = Ticket(
            spec,
            context,
            request.call_id,
            request,
            sink.queue,
            budget_ns // 1_000_000,
            source,
            decision.predicted_finish_ns or context.deadline_ns,
            start_ns,
            kv_blocks=request.block_ids if self.kv is not None else (),
        )
        self.in_flight[ticket.key] = ticket
        self.metrics.in_flight.set(len(self.in_flight))
        self.meter.register(request.call_id, context)
        ticket.usage_on_disk = self.outbox.expect(request.call_id)
        if start_ns is not None:  # held inside its slack for the slot planned for it
            delay_s = max(start_ns - self.clock.now_ns(), 0) / 1e9
            timer = sink.loop.call_later(delay_s, self._start_held, ticket.admission_key)
            self.held[ticket.admission_key] = (ticket, sink, timer)
            return ticket
        try:
            self.engine.add_request(request, sink)
        except errors.NotServing:  # the engine process died under us: undo the admission, then say so
            self._withdraw(ticket)
            raise
        return ticket

    def _start_held(self, key: str) -> None:
        """A held call's start has come, or a slot freed early: the engine has it for its next step."""
        entry = self.held.pop(key, None)
        if entry is None:
            return
        ticket, sink, timer = entry
        timer.cancel()
        self.awaiting_blocks.pop(key, None)
        if ticket.finish_reason is not None or ticket.device_failure is not None:
            return  # ended while held (the device failed: health/reaction.py)
        blocks_now = self.kv is not None and not ticket.request.blocks_reserved  # planned for its start
        if blocks_now and not self.kv.take_at_start(ticket):  # an ending call gives them back: it starts then
            self.held[key], self.awaiting_blocks[key] = entry, None
            return
        try:
            self.engine.add_request(ticket.request, sink)
        except errors.NotServing:  # the engine died while it was held: it ends as the device's calls do
            ticket.device_failure = "the engine stopped before this call's start"
            end = RequestOutput(ticket.call_id, (), "", self.clock.now_ns(), 0, FinishReason.ERROR)
            ticket.outputs.put_nowait(end)
            return
        if blocks_now:
            self.admission.started(key)

    def _withdraw(self, ticket: Ticket) -> None:
        """Forgets an admitted call that never reached the engine: nothing ran, nothing is billed."""
        self.meter.forget(ticket.call_id)
        self._untrack(ticket)

    def _untrack(self, ticket: Ticket) -> None:
        """Drops the call's slot in admission, its outbox waiter and its in-flight entry; a call held for a later
        start that a freed slot lets start now goes to the engine."""
        if (held := self.held.pop(ticket.admission_key, None)) is not None:
            held[2].cancel()
            self.awaiting_blocks.pop(ticket.admission_key, None)
        if self.kv is not None:
            self.kv.end(ticket)
        self.admission.release(ticket.admission_key)
        for key in list(self.awaiting_blocks):  # past their start: before those due early
            self._start_held(key)
        for key in self.admission.due(self.clock.now_ns()) if self.held else ():
            self._start_held(key)
        self.outbox.forget(ticket.call_id)
        if self.in_flight.get(ticket.key) is ticket:
            del self.in_flight[ticket.key]
        self.metrics.in_flight.set(len(self.in_flight))

    def _count_decision(self, attempt: str, result: str) -> None:
        self.metrics.retry_attempts.labels(attempt, result).inc()
        if result != "admitted":
            self.metrics.rejections.labels(result).inc()

    async def stream(self, ticket: Ticket) -> AsyncIterator[RequestOutput]:
        """Relays the engine's outputs; the last one carries the finish reason. Outputs that queued up while
        this call's relay waited for the loop go out as one message: a loop that falls behind sends fewer,
        larger messages instead of falling further behind (one output per step otherwise). With a stream
        interval, tokens after the first wait for the next output at least that long after the previous
        message, and go with it: the first token and the end are never held back."""
        last_ns, sent_ns, held = ticket.received_ns, None, []
        while ticket.finish_reason is None:
            outputs: list[RequestOutput] = [await ticket.outputs.get()]
            while outputs[-1].finish_reason is None and not ticket.outputs.empty():
                outputs.append(ticket.outputs.get_nowait())
            now_ns = self.clock.now_ns()
            self.metrics.relay_lag.observe((now_ns - outputs[0].time_ns) / 1e9)
            for output in outputs:
                last_ns = self._account(ticket, output, last_ns)
            held += outputs
            last = outputs[-1]
            if last.finish_reason is not None:
                ticket.finish_reason, ticket.finished_ns = last.finish_reason, last.time_ns
                if ticket.device_failure is not None and last.finish_reason is FinishReason.ERROR:
                    self.meter.end_now(self._ended(ticket), last.time_ns)  # ended by health/reaction.py: billed once
                elif ticket.device_failure is not None:  # the engine's own end came first: the call finished
                    ticket.device_failure = None
                await self._usage_on_disk(ticket)
                self.metrics.usage_durable.observe((self.clock.now_ns() - last.time_ns) / 1e9)
            elif sent_ns is not None and now_ns - sent_ns < self.stream_interval_ns:
                continue
            if ticket.first_token_ns is not None:
                sent_ns = now_ns
            yield held[0] if len(held) == 1 else RequestOutput.merged(held)
            held = []

    @staticmethod
    def _ended(ticket: Ticket) -> EndedRequest:
        prompt = len(ticket.spec.prompt_token_ids)
        status = RequestStatus.FINISHED_ERROR
        return EndedRequest(ticket.call_id, status, prompt, ticket.num_output_tokens, ticket.first_token_ns)

    def _account(self, ticket: Ticket, output: RequestOutput, last_ns: int) -> int:
        """One engine output's bookkeeping; returns the time of the call's latest token."""
        if ticket.first_scheduled_ns is None:
            ticket.first_scheduled_ns = output.first_scheduled_ns
        if output.token_ids:
            if self.kv is not None:
                ticket.output_token_ids.extend(output.token_ids)
            if ticket.first_token_ns is None:
                ticket.first_token_ns = output.time_ns
                if self.kv is not None:
                    self.kv.first_token(ticket)
                self.metrics.ttft.observe((output.time_ns - ticket.received_ns) / 1e9)
                first_step_ns = ticket.first_scheduled_ns or output.time_ns
                self.metrics.queue_time.observe((first_step_ns - ticket.received_ns) / 1e9)
                self.metrics.steps_waited.observe(self.steps.steps_began_between(ticket.dispatched_ns, first_step_ns))
            else:
                self.metrics.inter_token.observe((output.time_ns - last_ns) / 1e9)
            last_ns = output.time_ns
        ticket.num_output_tokens = output.num_output_tokens
        self.admission.on_progress(ticket.admission_key, output.num_output_tokens)
        return last_ns

    async def _usage_on_disk(self, ticket: Ticket) -> None:
        """Waits until the call's usage record is durable in the outbox: only then may its end be told."""
        try:
            ticket.usage = await asyncio.wrap_future(ticket.usage_on_disk)
        except Exception as exc:  # noqa: BLE001 - whatever kept the record off the disk
            raise errors.UsageNotRecorded(
                f"the usage of this request could not be recorded ({exc}); its result is withheld"
            ) from exc

    def close(self, ticket: Ticket) -> None:
        """Ends the call's bookkeeping; a call that ends before its stream did is cancelled in the engine."""
        if ticket.finish_reason is None and ticket.admission_key in self.held:  # never reached the engine
            prompt = len(ticket.spec.prompt_token_ids)
            cancelled = EndedRequest(ticket.call_id, RequestStatus.FINISHED_CANCELLED, prompt, 0, None)
            self.meter.end_now(cancelled, self.clock.now_ns())  # billed as a call cancelled in the engine's queue
            outcome = Outcome.CANCELLED
        elif ticket.finish_reason is None:
            self.engine.cancel(ticket.call_id)
            outcome = Outcome.CANCELLED
        else:
            outcome = OUTCOMES[ticket.finish_reason]
        if outcome is Outcome.OK:
            self.metrics.e2e.observe((ticket.finished_ns - ticket.received_ns) / 1e9)
            predicted = ticket.predicted_finish_ns - ticket.dispatched_ns
            if self.deadline_mode and predicted > 0:
                actual = ticket.finished_ns - ticket.dispatched_ns
                self.metrics.finish_error.observe(actual / predicted)
                # the prediction priced all of max_tokens: an early stop is no evidence of lateness (`Lateness`)
                if ticket.finish_reason is FinishReason.LENGTH:
                    self.admission.observe_finish(predicted, actual)
        if outcome is Outcome.DEADLINE_EXCEEDED or (outcome is Outcome.OK and not ticket.deadline_met):
            self.metrics.deadline_misses.inc()
        self.metrics.count_outcome(outcome.value, ticket.service_class)
        self._untrack(ticket)
        log.info("request_done", **ticket.summary(outcome.value, self.clock.now_ns()))
        if self.state is WarmupState.DRAINING and not self.in_flight:
            self.drained.set()

    def start_draining(self) -> None:
        self.state = WarmupState.DRAINING
        if not self.in_flight:
            self.drained.set()
