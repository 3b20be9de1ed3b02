"""Per-request device time, split exactly from every engine step. No torch here.

The engine alternates between steps and waiting for work, and the meter (in the server process, fed step
digests; or on the engine's thread with --engine-thread) accounts for every µs of it: a step is billed from the end of
the one before it (or from when work arrived after an idle
spell) to its own end, so the host work between back-to-back steps, during which the device is held
for those requests, is billed too; time with no request at all is idle, and so is the time a paced engine
idles out between steps (pacing.py: held for arrivals, used by no one). Hence, exactly,
    Σ billed unit·µs + Σ idle unit·µs = wall µs × units.
A step's cost is split over its requests by the tokens each had in it (a decode is one token, a prompt
chunk its length), in integer unit·µs with largest-remainder rounding, so the parts add up to the
whole. Padding rows of a graph bucket carry no weight: their cost falls on the real requests.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from billing.records import DEFAULT_CLASS, Door, IdleRecord, Outcome, RequestKind, UsageRecord

from .device.spec import Device
from .engine.digest import EndedRequest, StepDigest
from .sched.request import FinishReason, RequestStatus

US_PER_MINUTE = 60_000_000
# The billed outcome of each finish reason: the one map from the engine's word to the ledger's, used by the
# meter (the record) and the service (its metrics and log).
OUTCOMES = {
    FinishReason.STOP: Outcome.OK,
    FinishReason.LENGTH: Outcome.OK,
    FinishReason.CANCELLED: Outcome.CANCELLED,
    FinishReason.DEADLINE_EXCEEDED: Outcome.DEADLINE_EXCEEDED,
    FinishReason.ERROR: Outcome.ERROR,
    FinishReason.GRAMMAR: Outcome.ERROR,  # it ran, and is billed for what ran, but did not end as asked
}
_OUTCOMES = {status: OUTCOMES[status.finish_reason] for status in RequestStatus if status.is_finished}


def split_exact(total: int, weights: Sequence[int]) -> list[int]:
    """Integer parts of `total` proportional to `weights` that sum to `total` exactly (largest remainder;
    ties go to the earlier weight, so the split is deterministic)."""
    if total < 0 or any(w < 0 for w in weights):
        raise ValueError("total and weights must be non-negative")
    weight_sum = sum(weights)
    if weight_sum == 0:
        raise ValueError("at least one weight must be positive")
    if weight_sum == len(weights):  # all ones, every decode-only step: the same rule, cheaper
        share, extra = divmod(total, len(weights))
        return [share + (i < extra) for i in range(len(weights))]
    parts = [total * w // weight_sum for w in weights]
    remainders = [total * w % weight_sum for w in weights]
    for i in sorted(range(len(weights)), key=lambda i: (-remainders[i], i))[: total - sum(parts)]:
        parts[i] += 1
    return parts


@dataclass(frozen=True)
class RecordContext:
    """What the service knows of an admitted call that the engine does not, fixed at admission. It is the
    frozen part of the service's `Ticket` (which holds it, not a copy): the meter reads it off the event loop,
    on the engine's thread with --engine-thread. Times are on the engine clock; the meter makes them epoch µs."""

    tenant: str
    labels: Mapping[str, str]
    received_ns: int
    dispatched_ns: int  # admitted: handed to the engine
    deadline_ns: int
    request_id: str = ""  # the caller's (the record's own id, call_id, is the call's)
    service_class: str = DEFAULT_CLASS  # the class the call runs and is billed in
    request_kind: RequestKind = RequestKind.PLAIN  # plain, chat, constrained or both: labels the record's device time
    door: Door = Door.GRPC  # the door the call came through (gRPC or HTTP): labels it, prices nothing


@dataclass
class MinuteTotals:
    wall_us: int = 0
    idle_us: int = 0


@dataclass
class Meter:
    """Engine-thread observer. `write` receives finished requests' records (as builders, so validation
    happens off this thread) and closed minutes' idle records, before the engine emits the final outputs."""

    device: Device
    model: str  # the model this replica serves, on every record
    boot_id: str
    epoch_us: Callable[[int], int]  # engine clock ns -> µs since the epoch
    write: Callable[[list[Callable[[], UsageRecord]], list[IdleRecord]], None]
    started_ns: int
    count: Callable[[str, str, str, int], None] | None = None  # (tenant, cost_center, unit, unit_us) per record
    weight_dtype: str = ""  # the model's decoder weights (ModelCard.weight_dtype), on every record; '': unknown
    contexts: dict[str, RecordContext] = field(default_factory=dict)
    usage_unit_us: dict[str, int] = field(default_factory=dict)
    minutes: dict[int, MinuteTotals] = field(default_factory=dict)
    billed_unit_us: int = 0
    idle_unit_us: int = 0
    _close_due_us: int = 0  # no minute can close before this epoch µs
    _last_ns: int = 0
    _busy: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._last_ns = self.started_ns

    def register(self, call_id: str, context: RecordContext) -> None:
        """Called by the service when it admits a request, before the engine sees it."""
        with self._lock:
            self.contexts[call_id] = context

    def forget(self, call_id: str) -> None:
        """Called by the service for an admitted request that never reached the engine."""
        with self._lock:
            self.contexts.pop(call_id, None)

    def on_step(self, digest: StepDigest) -> None:
        with self._lock:
            if digest.work:
                self._bill_step(digest)
            elif digest.num_unfinished == 0:
                # requests ended without running (cancelled, expired) and none is left: from here on the
                # device waits for work, and that time is idle, not the next request's
                self._busy = False
            records = [self._record(r, digest.ended_ns) for r in digest.ended if r.call_id in self.contexts]
            for request in digest.ended:  # one already billed (its device failed: health/reaction.py) is billed no more
                self.usage_unit_us.pop(request.call_id, None)
            idle = self._close_minutes(digest.ended_ns)
        if records or idle:
            self.write(records, idle)

    def end_now(self, request: EndedRequest, now_ns: int) -> None:
        """Bills a call the service ended itself (its device stopped answering) for the steps that ran, unless it
        is billed already."""
        self.on_step(StepDigest(now_ns, now_ns, False, (), 0, (request,), 1, 0))

    def on_idle(self, now_ns: int, final: bool = False) -> None:
        """Accounts idle time up to now and closes finished minutes (all of them when `final`)."""
        with self._lock:
            if not self._busy and now_ns > self._last_ns:
                self._account(self._last_ns, now_ns, idle=True)
            idle = self._close_minutes(now_ns, final)
        if idle:
            self.write([], idle)

    @property
    def wall_unit_us(self) -> int:
        """Wall time accounted so far × units: always billed + idle."""
        return self.device.num_units * (self.epoch_us(self._last_ns) - self.epoch_us(self.started_ns))

    def _bill_step(self, digest: StepDigest) -> None:
        if self._busy:
            start_ns = self._last_ns
            if digest.paced_ns:  # the engine idled on purpose between the steps (paced): no one's usage
                start_ns = min(start_ns + digest.paced_ns, digest.began_ns)
                self._account(self._last_ns, start_ns, idle=True)
        else:
            start_ns = max(digest.began_ns, self._last_ns)
            self._account(self._last_ns, start_ns, idle=True)
        span_us = self._account(start_ns, digest.ended_ns, idle=False)
        total = self.device.num_units * span_us
        usage = self.usage_unit_us
        for (rid, _), part in zip(digest.work, split_exact(total, [n for _, n in digest.work])):
            usage[rid] = usage.get(rid, 0) + part
        self.billed_unit_us += total
        self._busy = digest.num_unfinished > 0

    def _account(self, start_ns: int, end_ns: int, idle: bool) -> int:
        """Adds [start, end) to the UTC minutes it covers; returns its length in µs. Lengths are taken on
        the epoch µs of each end, so consecutive spans add up exactly to the whole."""
        start_us, end_us = self.epoch_us(start_ns), self.epoch_us(end_ns)
        at = start_us
        while at < end_us:
            minute = at - at % US_PER_MINUTE
            cut = min(end_us, minute + US_PER_MINUTE)
            totals = self.minutes.setdefault(minute, MinuteTotals())
            totals.wall_us += cut - at
            if idle:
                totals.idle_us += cut - at
            at = cut
        if idle:
            self.idle_unit_us += self.device.num_units * max(end_us - start_us, 0)
        self._last_ns = max(self._last_ns, end_ns)
        return max(end_us - start_us, 0)

    def _close_minutes(self, now_ns: int, final: bool = False) -> list[IdleRecord]:
        now_us = self.epoch_us(now_ns)
        if now_us < self._close_due_us and not final:
            return []
        current = now_us - now_us % US_PER_MINUTE
        self._close_due_us = current + US_PER_MINUTE
        closed = [m for m in self.minutes if final or m < current]
        d, records = self.device, []
        for minute in sorted(closed):
            totals = self.minutes.pop(minute)
            if totals.wall_us:
                records.append(
                    IdleRecord(
                        f"{d.device_id}:{self.boot_id}:{minute // US_PER_MINUTE}",
                        d.device_id,
                        d.unit,
                        d.num_units,
                        minute,
                        totals.idle_us * d.num_units,
                        totals.wall_us * d.num_units,
                    )
                )
        return records

    def _record(self, request: EndedRequest, ended_ns: int) -> Callable[[], UsageRecord]:
        """The request's record, built (and validated) later by whoever calls it: off the engine's thread."""
        ctx = self.contexts.pop(request.call_id)
        finished_us, deadline_us = self.epoch_us(ended_ns), self.epoch_us(ctx.deadline_ns)
        first_token_us = None if request.first_token_ns is None else self.epoch_us(request.first_token_ns)
        outcome = _OUTCOMES[request.status]
        met = finished_us <= deadline_us and outcome not in (Outcome.DEADLINE_EXCEEDED, Outcome.ERROR)
        d = self.device
        unit_us = self.usage_unit_us.pop(request.call_id, 0)
        if self.count is not None:
            self.count(ctx.tenant, ctx.labels.get("cost_center", ""), d.unit, unit_us)
        return functools.partial(
            UsageRecord,
            call_id=request.call_id,
            tenant=ctx.tenant,
            labels=ctx.labels,
            model=self.model,
            device_kind=d.kind,
            device_id=d.device_id,
            unit=d.unit,
            num_units=d.num_units,
            unit_us=unit_us,
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_output_tokens,
            received_at_us=self.epoch_us(ctx.received_ns),
            dispatched_at_us=self.epoch_us(ctx.dispatched_ns),
            first_token_at_us=first_token_us,
            finished_at_us=finished_us,
            deadline_at_us=deadline_us,
            deadline_met=met,
            outcome=outcome,
            request_id=ctx.request_id,
            service_class=ctx.service_class,
            request_kind=ctx.request_kind,
            door=ctx.door,
            cached_prompt_tokens=request.num_cached_tokens,
            weight_dtype=self.weight_dtype,
        )
