"""The step loop: schedule, run, update, emit. It runs on its own thread; other threads talk to it
through `add_request` and `cancel`, which take effect at the start of the very next step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, Protocol

import structlog

from ..cost.model import CostModel
from ..device.spec import is_device_fault
from ..grammar import GrammarLimits
from ..health.watchdog import Watchdog
from ..sched.request import FinishReason, Request, RequestStatus
from ..sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, StepUpdate
from .detokenizer import Detokenizer
from .digest import Observers, StepObserver, StepReport, StepSink
from .grammars import GrammarBook
from .pacing import Pacer

if TYPE_CHECKING:
    from ..device.executor import Executor

log = structlog.get_logger(__name__)


class RequestOutput(NamedTuple):
    """A named tuple: made for every token, and (as a plain tuple) pickled to the server process."""

    call_id: str
    token_ids: tuple[int, ...]  # new tokens since the previous output (stop tokens are not streamed)
    text: str  # new text; held back while it may be the start of a stop string
    time_ns: int  # engine clock when the step that produced it ended
    num_output_tokens: int  # generated so far, stop tokens included
    finish_reason: FinishReason | None = None  # set on a request's last output
    first_scheduled_ns: int | None = None  # start of the first step that ran the request
    logprobs: tuple[tuple, ...] = ()  # with SamplingParams.logprobs: one per token id (sampler.TokenLogprob)

    @staticmethod
    def merged(outputs: list[RequestOutput]) -> RequestOutput:
        """Consecutive outputs of one call as one (a relay that fell behind sends them in one message): their
        tokens and text in order, the time of the first (when the message's first token was produced), the state
        of the last."""
        first = outputs[0]
        return outputs[-1]._replace(
            token_ids=tuple(t for o in outputs for t in o.token_ids),
            logprobs=tuple(lp for o in outputs for lp in o.logprobs),
            text="".join(o.text for o in outputs),
            time_ns=first.time_ns,
            first_scheduled_ns=first.first_scheduled_ns,
        )


class OutputSink(Protocol):
    def put(self, output: RequestOutput) -> None: ...


@dataclass
class _Stream:
    sink: OutputSink
    detokenizer: Detokenizer


class Engine:
    def __init__(
        self,
        executor: Executor,
        tokenizer,
        eos_token_ids: Sequence[int] = (),
        max_num_batched_tokens: int = 256,
        clock: Callable[[], int] = time.monotonic_ns,
        observers: Sequence[StepObserver] = (),
        sink: StepSink | None = None,
        pacer: Pacer | None = None,
        watchdog: Watchdog | None = None,
        on_lost: Callable[[str], None] | None = None,
        grammars: GrammarBook | None = None,
        step_cost: CostModel | None = None,
        earliest_deadline_first: bool = False,
    ) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.scheduler = Scheduler(
            SchedulerConfig(
                executor.num_slots,
                executor.max_seq_len,
                max(max_num_batched_tokens, executor.num_slots + 1),
                executor.block_size,
                executor.num_blocks,
                earliest_deadline_first,
            )
        )
        self.clock = clock
        self.observers = list(observers)
        self.sink: StepSink = Observers(self.observers) if sink is None else sink  # where each step goes
        self.expiry_guard_ns = 0  # the service sets this to about one step: the guard of an uncalibrated engine
        # a copy of the calibration, its running ratio learnt from this engine's own steps: how long the step about
        # to start should take (None: uncalibrated)
        self.step_cost = step_cost
        self._last_step_ratio = 1.0  # the last step's measured time over its calibrated time
        self.last_interval_ns = 0
        self.idle_tick_s = 1.0  # how often observers hear of idle time while there is no work
        self.pacer = pacer  # paced steps (pacing.py); None: each step starts when the last ends
        self.on_lost = on_lost  # the loop stopped on a device fault (called on the engine's thread)
        self.watchdog = watchdog  # it times the executor (health/watchdog.py); the idle device is probed
        # structured output: constrained calls wait here for their grammar's compile, outside the scheduler
        self.grammars = grammars or GrammarBook(tokenizer, self.eos_token_ids, GrammarLimits())
        self._idle_told_ns = 0
        self._paced_ns = 0  # idled out since the last reported step
        self._streams: dict[str, _Stream] = {}
        self._inbox: list[tuple[Request, OutputSink] | str] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._running = False

    # ---- called from any thread ----
    def add_request(self, request: Request, sink: OutputSink) -> None:
        """Queues `request` for the next step; the model's end-of-sequence ids stop it unless ignore_eos."""
        stop_ids = request.sampling.stop_token_ids | (
            frozenset() if request.sampling.ignore_eos else self.eos_token_ids
        )
        if stop_ids != request.sampling.stop_token_ids:
            request.sampling = replace(request.sampling, stop_token_ids=stop_ids)
        with self._wake:
            self._inbox.append((request, sink))
            self._wake.notify()

    def cancel(self, call_id: str) -> None:
        with self._wake:
            self._inbox.append(call_id)
            self._wake.notify()

    def set_expiry_guard(self, guard_ns: int) -> None:
        """Requests whose deadline falls within this of a step's start end before it (about one step)."""
        self.expiry_guard_ns = guard_ns

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="zeroqueue-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.watchdog is not None:
            self.watchdog.stop()
        self.grammars.close()

    # ---- engine thread ----
    def step(self) -> StepReport | None:
        """One step; its report goes to the sink before its outputs, and the sink is flushed after them."""
        report = self._step()
        self.sink.flush()
        return report

    def _step(self) -> StepReport | None:
        began_ns = self.clock()
        cancelled = self._drain_inbox()
        guard_ns = self.expiry_guard()
        if self.grammars.waiting:
            cancelled += self.grammars.schedule_compiled(self.scheduler, began_ns, guard_ns)
        scheduled = self.scheduler.schedule(began_ns, guard_ns)
        started_ns, result, updates, texts = self.clock(), None, (), {}
        if not scheduled.is_empty:
            result = self.executor.run(scheduled)
            sampled = result.sampled
            if result.grammar_errors:  # a failed matcher's token is meaningless: the call ends without it
                sampled = {k: t for k, t in sampled.items() if k not in result.grammar_errors}
            updates = tuple(self.scheduler.update_from_output(scheduled, sampled))
            if result.num_masked_rows:  # a constrained call drew: its output may be whole, or its matcher failed
                self.grammars.end_outputs(self.scheduler, updates, result.grammar_errors)
            texts = self._detokenize(updates)
        elif self.grammars.waiting and not cancelled:
            self.grammars.wait(0.005)  # nothing to run but compiles: wait for one rather than spin
        ended_ns = self.clock()
        for update in updates:
            if update.new_token_id is not None and update.request.first_token_ns is None:
                update.request.first_token_ns = ended_ns
        closed = (*cancelled, *scheduled.expired)
        ended = (*closed, *(u.request for u in updates if u.request.is_finished))
        if result is None and not ended:
            return None
        report = StepReport(
            scheduled,
            result,
            updates,
            ended,
            began_ns,
            started_ns,
            ended_ns,
            self.scheduler.num_unfinished,
            self._paced_ns,
            self.scheduler.kv_counts,
        )
        self._paced_ns = 0
        if result is not None:
            self.last_interval_ns = report.interval_ns
            if self.step_cost is not None:
                self._learn_speed(scheduled, report.interval_ns)
        self.sink.report(report, self.scheduler.num_free_slots)
        for request in closed:
            self._close(request, ended_ns)
        logprobs = result.logprobs if result is not None else {}
        for update in updates:
            call_id = update.request.call_id
            self._emit(update, texts.get(call_id, ""), ended_ns, logprobs.get(call_id))
        return report

    def expiry_guard(self) -> int:
        """A request whose deadline falls within this of the step about to start cannot get its next token in time:
        it ends now, so its caller hears DEADLINE_EXCEEDED from us before its own timer fires. Calibrated, the
        guard is the expected time of this step's own rows (a token per decoding request, and as much waiting
        prompt as the step's budget takes) at the speed this engine's steps have run: their running ratio, or the
        last step's alone if slower (a device that has just slowed down). A guard taken from the last
        step, when that one filled a prompt, is several decode steps long: it ended calls that had time to finish
        (on a 2-core replica at 2x its capacity, 2-3 % of the admitted calls, most with one token left).
        Too short a guard costs only a cleaner ending: a call it misses still misses, by its caller's timer.
        Uncalibrated: the service's guard, or 1.5 x the last step if that was longer."""
        if self.step_cost is None:
            return max(self.expiry_guard_ns, self.last_interval_ns * 3 // 2)
        num_rows, context_tokens = self.scheduler.next_step_size()
        speed = max(self.step_cost.ratio, self._last_step_ratio)
        return int(self.step_cost.raw_step_us(num_rows, context_tokens) * speed * 1000)

    def _learn_speed(self, scheduled: SchedulerOutput, interval_ns: int) -> None:
        """The step's measured time against its calibrated time (a chunk's reads of the positions before it apart,
        as the server's running ratio takes them): the speed the next guard is forecast at."""
        cost = self.step_cost
        reads_us = scheduled.prefill_context_tokens * cost.us_per_prefill_context_token
        self._last_step_ratio = cost.observe(
            scheduled.num_tokens, scheduled.context_tokens, interval_ns // 1000, reads_us
        )

    def pace(self, report: StepReport | None) -> None:
        """With a pacer, idles out the rest of the floor of a step that ran while requests are still in flight;
        calls that arrive meanwhile join the next step, on the cadence."""
        if self.pacer is None or report is None or report.result is None:
            return
        scheduled, context_tokens = report.scheduled, report.scheduled.context_tokens
        self.pacer.observe(
            scheduled.num_tokens, scheduled.num_tokens - len(scheduled.decodes), context_tokens, report.interval_ns
        )
        if report.num_unfinished == 0:
            return
        floor_ns = self.pacer.floor_ns(scheduled.num_seqs, context_tokens)
        self._paced_ns += self.pacer.idle_out(report.began_ns, floor_ns, self.clock)
        self.last_interval_ns = max(self.last_interval_ns, floor_ns)

    @property
    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._inbox) or bool(self.grammars.waiting)

    @property
    def idle_wait_s(self) -> float:
        """How long the idle loop waits for work: a probe period when the device is watched."""
        return self.idle_tick_s if self.watchdog is None else min(self.idle_tick_s, self.watchdog.config.period_s)

    def idle(self) -> None:
        """No work: probes the device when it is watched, and tells the sink of idle time once per idle tick."""
        if self.watchdog is not None:
            self.executor.probe()
        now_ns = self.clock()
        if now_ns - self._idle_told_ns >= (self.idle_tick_s - self.idle_wait_s / 2) * 1e9:
            self._idle_told_ns = now_ns
            self.sink.on_idle(now_ns)

    def _loop(self) -> None:
        while True:
            with self._wake:
                if self._running and not self.has_work:
                    self._wake.wait(self.idle_wait_s)
                idle = not self.has_work
                if idle and not self._running:
                    return
            try:
                if idle:
                    self.idle()
                else:
                    self.pace(self.step())
            except Exception as exc:  # noqa: BLE001 - a failed step must not kill the loop; its calls end with "error"
                if not self.recover(exc):
                    if self.on_lost is not None:
                        self.on_lost(f"device fault: {exc}")
                    return

    def recover(self, exc: Exception) -> bool:
        """After a failed step (call it from the handler): every call ends with "error". False when the device
        is at fault: nothing more can run on it, and the loop must stop."""
        fault = is_device_fault(exc)
        if fault:
            log.critical("engine_device_fault", exc_info=True)
        else:
            log.exception("engine_step_failed")
        self.fail_all()
        return not fault

    def _drain_inbox(self) -> list[Request]:
        """Takes new requests in and ends cancelled ones; returns those it ended."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        cancelled = []
        for item in inbox:
            if isinstance(item, str):
                waiting = self.grammars.cancel(item) if self.grammars.waiting else None
                status = RequestStatus.FINISHED_CANCELLED
                cancelled += [waiting] if waiting else self.scheduler.finish_requests([item], status)
                continue
            request, sink = item
            self._streams[request.call_id] = _Stream(sink, Detokenizer(self.tokenizer, request.sampling.stop))
            if request.sampling.constraint is None or self.grammars.take(request):
                self.scheduler.add_request(request)
        return cancelled

    def _detokenize(self, updates: tuple[StepUpdate, ...]) -> dict[str, str]:
        """New text per request; a request whose text now holds a stop string ends here, before any emit."""
        texts = {}
        for update in updates:
            request, token = update.request, update.new_token_id
            if token is None or token in request.sampling.stop_token_ids:
                continue
            detokenizer = self._streams[request.call_id].detokenizer
            try:
                texts[request.call_id] = detokenizer.push(token)
            except Exception:  # noqa: BLE001 - one call's text (its stop strings, its tokens) ends that call alone
                log.exception("detokenize_failed", call_id=request.call_id)
                self.scheduler.finish_requests([request.call_id], RequestStatus.FINISHED_ERROR)
                continue
            if detokenizer.stopped:
                self.scheduler.finish_requests([request.call_id], RequestStatus.FINISHED_STOPPED)
        return texts

    def _emit(self, update: StepUpdate, text: str, time_ns: int, logprob: tuple | None) -> None:
        request, token = update.request, update.new_token_id
        streamed = token is not None and token not in request.sampling.stop_token_ids
        stream = self._streams[request.call_id]
        if request.is_finished:
            if request.status is not RequestStatus.FINISHED_ERROR:  # a failed text has nothing more to give
                text += stream.detokenizer.flush()
            del self._streams[request.call_id]
        output = RequestOutput(
            request.call_id,
            (token,) if streamed else (),
            text,
            time_ns,
            request.num_output_tokens,
            request.status.finish_reason,
            request.first_scheduled_ns,
            (logprob,) if streamed and logprob is not None else (),
        )
        if output.token_ids or output.text or output.finish_reason:
            stream.sink.put(output)

    def _close(self, request: Request, time_ns: int) -> None:
        stream = self._streams.pop(request.call_id, None)
        if stream is not None:
            stream.sink.put(
                RequestOutput(
                    request.call_id,
                    (),
                    stream.detokenizer.flush(),
                    time_ns,
                    request.num_output_tokens,
                    request.status.finish_reason,
                    request.first_scheduled_ns,
                )
            )

    def fail_all(self) -> None:
        """After a failed step: every request ends with "error", the sink first, then its stream."""
        ids = [r.call_id for r in (*self.scheduler.running, *self.scheduler.waiting)]
        failed = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR) + self.grammars.fail_all()
        now_ns = self.clock()
        empty = SchedulerOutput((), (), ())
        try:
            report = StepReport(empty, None, (), tuple(failed), now_ns, now_ns, now_ns, 0)
            self.sink.report(report, self.scheduler.num_free_slots)
        except Exception:  # noqa: BLE001 - the streams must still be closed
            log.exception("observer_failed_on_error")
        for request in failed:
            self._close(request, now_ns)
        self.sink.flush()
