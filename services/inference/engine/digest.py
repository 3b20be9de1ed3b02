"""What observers (the meter, the cost model, the metrics) learn of each engine step: plain data, so the same
observers work on the engine's thread and in the server process across a pipe. No torch here.

Named tuples, not dataclasses: a digest is built on every step. Across the pipe it travels as plain tuples of
ints and strings (`step_wire`), which pickle several times faster than a dataclass (bench/metering_overhead.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ..device.spec import StepResult
from ..sched.request import Request, RequestStatus
from ..sched.scheduler import SchedulerOutput, StepUpdate


class EndedRequest(NamedTuple):
    call_id: str
    status: RequestStatus
    num_prompt_tokens: int
    num_output_tokens: int
    first_token_ns: int | None
    num_cached_tokens: int = 0  # leading prompt tokens the prefix cache served (never computed for this call)


class StepDigest(NamedTuple):
    began_ns: int  # step() entered: taking new requests and scheduling count too
    ended_ns: int
    ran: bool  # the executor ran; False when requests only ended (cancelled, expired)
    work: tuple[tuple[str, int], ...]  # (call_id, tokens run): decodes first (1 each), then prompt chunks
    context_tokens: int  # positions the decode rows attended to, summed
    ended: tuple[EndedRequest, ...]  # finished, cancelled or expired in this step
    num_unfinished: int  # requests still in the engine after this step
    num_free_slots: int
    paced_ns: int = 0  # idle on purpose before this step (paced steps): billed to no one
    num_masked_rows: int = 0  # rows drawn under a grammar's mask (structured output)
    num_logprob_rows: int = 0  # rows that reported log-probabilities
    prefill_context_tokens: int = 0  # cache positions before their chunk the prompt rows read, summed over rows
    # the KV block pool after the step (Scheduler.kv_counts): blocks held and cached now, then running totals
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens the prefix cache served
    prefix_queried_tokens: int = 0  # prompt tokens of the calls that looked in it
    prefix_hit_calls: int = 0
    prefix_queried_calls: int = 0
    kv_evicted_blocks: int = 0

    @property
    def interval_ns(self) -> int:
        return self.ended_ns - self.began_ns

    @property
    def num_seqs(self) -> int:
        return len(self.work)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)

    @classmethod
    def from_wire(cls, wire: tuple) -> StepDigest:
        """The digest that `step_wire` shipped, rebuilt in the server process (off the engine's core)."""
        # the fields after the ended requests (unfinished, free slots, paced ns, masked and logprob rows, the
        # prompt rows' reads of earlier positions, the KV pool's counts) travel as they are, in the digest's order
        began_ns, ended_ns, ran, decode_ids, prefills, context_tokens, ended, *counts = wire
        work = tuple([(rid, 1) for rid in decode_ids]) + prefills
        ended = tuple(
            [
                EndedRequest(rid, RequestStatus(status), prompt, output, first, cached)
                for rid, status, prompt, output, first, cached in ended
            ]
        )
        return cls(began_ns, ended_ns, ran, work, context_tokens, ended, *counts)


def step_wire(report, num_free_slots: int) -> tuple:
    """The digest of an engine step (a StepReport) as plain tuples of ints and strings, built straight from the
    report on the engine's core: this is all the engine process pays per step for its observers (the meter, the
    cost model and the metrics run in the server process). Decodes go as bare request ids (1 token each),
    statuses as ints: fewer objects to build and to pickle."""
    decodes, prefills = report.scheduled.decodes, report.scheduled.prefills
    ended = (
        tuple(
            [
                (
                    r.call_id,
                    int(r.status),
                    len(r.prompt_token_ids),
                    len(r.output_token_ids),
                    r.first_token_ns,
                    r.num_cached_tokens,
                )
                for r in report.ended
            ]
        )
        if report.ended
        else ()
    )
    return (
        report.began_ns,
        report.ended_ns,
        report.result is not None,
        tuple([s.request.call_id for s in decodes]),
        tuple([(s.request.call_id, len(s.token_ids)) for s in prefills]) if prefills else (),
        report.scheduled.context_tokens,
        ended,
        report.num_unfinished,
        num_free_slots,
        report.paced_ns,
        *report.host_rows,
        report.scheduled.prefill_context_tokens,
        *report.kv_counts,
    )


def ended_request(request: Request) -> EndedRequest:
    return EndedRequest(
        request.call_id,
        request.status,
        request.num_prompt_tokens,
        request.num_output_tokens,
        request.first_token_ns,
        request.num_cached_tokens,
    )


@dataclass(frozen=True)
class StepReport:
    scheduled: SchedulerOutput
    result: StepResult | None  # None when nothing ran but requests ended (cancelled, expired)
    updates: tuple[StepUpdate, ...]
    ended: tuple[Request, ...]  # requests that finished, were cancelled or expired in this step
    began_ns: int  # step() entered: taking new requests and scheduling count too
    started_ns: int  # handed to the executor
    ended_ns: int
    num_unfinished: int  # requests still in the engine after this step
    paced_ns: int = 0  # the engine idled this long on purpose (paced steps) before this step
    kv_counts: tuple[int, ...] = ()  # the KV block pool's counts after it (Scheduler.kv_counts); (): none

    @property
    def interval_ns(self) -> int:
        return self.ended_ns - self.began_ns

    @property
    def host_rows(self) -> tuple[int, int]:
        """(rows drawn under a grammar's mask, rows that reported log-probabilities): the digest's last two counts."""
        if self.result is None:
            return 0, 0
        return self.result.num_masked_rows, len(self.result.logprobs)


class StepObserver(Protocol):
    """Sees every step before its outputs are emitted (the meter must record usage before a final message)."""

    def on_step(self, digest: StepDigest) -> None: ...

    def on_idle(self, now_ns: int) -> None: ...


class StepSink(Protocol):
    """Where the engine hands each step: its report before the step's outputs are emitted (so usage is recorded
    before a final message), `flush` once they are, and `on_idle` while there is no work. On the engine's
    thread that is `Observers`; in the engine process, the relay to the server (core.py)."""

    def report(self, report: StepReport, num_free_slots: int) -> None: ...

    def flush(self) -> None: ...

    def on_idle(self, now_ns: int) -> None: ...


class Observers:
    """The in-thread sink: builds each step's digest and hands it to the observers on the engine's thread."""

    def __init__(self, observers: list[StepObserver]) -> None:
        self.observers = observers  # the engine's own list: observers added to it later are heard too

    def report(self, report: StepReport, num_free_slots: int) -> None:
        if not self.observers:
            return
        decodes, prefills = report.scheduled.decodes, report.scheduled.prefills
        # list comprehensions: this runs every step, and they take 2/3 of the time of unpacked generators
        work = tuple(
            [(s.request.call_id, 1) for s in decodes] + [(s.request.call_id, len(s.token_ids)) for s in prefills]
        )
        digest = StepDigest(
            report.began_ns,
            report.ended_ns,
            report.result is not None,
            work,
            report.scheduled.context_tokens,
            tuple([ended_request(r) for r in report.ended]),
            report.num_unfinished,
            num_free_slots,
            report.paced_ns,
            *report.host_rows,
            report.scheduled.prefill_context_tokens,
            *report.kv_counts,
        )
        for observer in self.observers:
            observer.on_step(digest)

    def flush(self) -> None:
        pass

    def on_idle(self, now_ns: int) -> None:
        for observer in self.observers:
            observer.on_idle(now_ns)
