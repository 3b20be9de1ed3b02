"""The engine's grammars (structured output): compiled matchers cached by constraint key, compiled on a thread of
their own so that no step waits for a compile, and the constrained calls waiting for theirs. A waiting call is in
the engine (it can be cancelled, it can expire) but not yet in the scheduler: it takes no slot and no step until
its matcher is ready. The server compiled the same constraint before admitting the call (compiler.py), so a
failure here is unexpected; the call then ends with "error", alone. No torch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import structlog
from tokenizers import Tokenizer

from ..grammar import Constraint, GrammarLimits, MatcherCache, compile_matcher, grammar_tokenizer, support_error
from ..sched.request import Request, RequestStatus
from ..sched.scheduler import Scheduler, StepUpdate

log = structlog.get_logger(__name__)


class GrammarBook:
    def __init__(
        self, tokenizer: Tokenizer, stop_token_ids: Iterable[int], limits: GrammarLimits, capacity: int = 256
    ) -> None:
        self.limits = limits
        self.matchers = MatcherCache(capacity)
        self._tokenizer = tokenizer
        self._stop_ids = tuple(stop_token_ids)
        self._grammar_tokenizer = None  # built on the compile thread by the first compile (~20 ms to ~1 s)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiles: dict[str, Future] = {}  # constraint key -> its compile in flight
        # call id -> a call waiting for its grammar, and that grammar's compile (read it, do not change it)
        self.waiting: dict[str, tuple[Request, Future]] = {}
        self._lock = threading.Lock()

    def take(self, request: Request) -> bool:
        """Gives a constrained `request` its matcher: True when the grammar was compiled already, False when the
        request waits for its compile (`ready` hands it over later)."""
        constraint = request.sampling.constraint
        assert constraint is not None
        matcher = self.matchers.copy(constraint.key)
        if matcher is not None:
            request.matcher = matcher
            return True
        with self._lock:
            future = self._compiles.get(constraint.key)
            if future is None:
                future = self._compiles[constraint.key] = self._pool.submit(self._compile, constraint)
        self.waiting[request.call_id] = (request, future)
        return False

    def _llg_tokenizer(self):
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self._tokenizer, self._stop_ids)
        return self._grammar_tokenizer

    def support_error(self) -> str:
        """Why this model's tokenizer cannot be served under grammars ('' when it can): grammar.support_error."""
        return support_error(self._tokenizer, self._llg_tokenizer(), self.limits)

    def _compile(self, constraint: Constraint) -> None:
        try:
            self.matchers.put(constraint.key, compile_matcher(self._llg_tokenizer(), constraint, self.limits))
        finally:
            with self._lock:
                self._compiles.pop(constraint.key, None)

    def schedule_compiled(self, scheduler: Scheduler, now_ns: int, expiry_guard_ns: int) -> list[Request]:
        """Schedules the waiting requests whose grammar is now compiled; returns those that ended waiting."""
        ready, ended = self.ready(now_ns, expiry_guard_ns)
        for request in ready:
            scheduler.add_request(request)
        return ended

    def end_outputs(self, scheduler: Scheduler, updates: tuple[StepUpdate, ...], errors: dict[str, str]) -> None:
        """After a step: a constrained call whose output is now whole ends "stop" (on its last allowed token too:
        the output is complete, not cut); one whose matcher failed (`errors`) ends with its grammar's failure."""
        for update in updates:
            request = update.request
            if request.matcher is None:
                continue
            if request.call_id in errors:
                log.warning("grammar_failed", call_id=request.call_id, error=errors[request.call_id])
                scheduler.finish_requests([request.call_id], RequestStatus.FINISHED_GRAMMAR)
            elif request.matcher.is_stopped and request.status is RequestStatus.RUNNING:
                scheduler.finish_requests([request.call_id], RequestStatus.FINISHED_STOPPED)
            elif request.matcher.is_stopped and request.status is RequestStatus.FINISHED_LENGTH:
                request.status = RequestStatus.FINISHED_STOPPED

    def ready(self, now_ns: int, expiry_guard_ns: int) -> tuple[list[Request], list[Request]]:
        """(waiting requests whose matcher is now ready, to schedule; waiting requests that end here: expired
        before their grammar was ready, or whose compile failed), the ended ones with their status set."""
        ready, ended = [], []
        for call_id, (request, future) in list(self.waiting.items()):
            if request.deadline_ns is not None and request.deadline_ns - expiry_guard_ns <= now_ns:
                request.status = RequestStatus.FINISHED_EXPIRED
            elif not future.done():
                continue
            elif (matcher := self._compiled(request, future)) is None:
                request.status = RequestStatus.FINISHED_ERROR
            else:
                request.matcher = matcher
                ready.append(request)
                del self.waiting[call_id]
                continue
            ended.append(request)
            del self.waiting[call_id]
        return ready, ended

    def _compiled(self, request: Request, future: Future):
        """The request's matcher once its compile is done; None (logged) when the compile failed."""
        if future.exception() is None:
            matcher = self.matchers.copy(request.sampling.constraint.key)
            if matcher is not None:  # else evicted already, by as many other grammars as the cache holds
                return matcher
        log.error("grammar_compile_failed", call_id=request.call_id, error=str(future.exception() or "evicted"))
        return None

    def cancel(self, call_id: str) -> Request | None:
        """Ends a waiting request (its status set); None when `call_id` is not waiting here."""
        entry = self.waiting.pop(call_id, None)
        if entry is None:
            return None
        entry[0].status = RequestStatus.FINISHED_CANCELLED
        return entry[0]

    def fail_all(self) -> list[Request]:
        """Every waiting request ends with "error" (after a failed step, as the scheduled ones do)."""
        failed = [request for request, _ in self.waiting.values()]
        for request in failed:
            request.status = RequestStatus.FINISHED_ERROR
        self.waiting.clear()
        return failed

    def wait(self, timeout_s: float) -> None:
        """Blocks until a waiting request's compile ends, or `timeout_s`: the engine has nothing else to run."""
        futures = [future for _, future in self.waiting.values()]
        if futures:
            wait_futures(futures, timeout_s, return_when="FIRST_COMPLETED")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
