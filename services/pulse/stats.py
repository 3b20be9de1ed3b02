"""What a pulse run measured, from its per-request trace. Pure: tests feed it synthetic traces.

Definitions (times in seconds since the run began, on the client's monotonic clock):
  latency            call start -> final message, completed calls (retry waits included: what the caller sees)
  admitted latency   start of the admitted attempt -> final message; P99/P50 is taken over this one
  TTFT               call start -> first token; admitted TTFT from the admitted attempt
  rejection rate     calls whose first attempt was refused OVERLOADED / calls sent
  retries            attempts - 1; averaged over calls that were refused at least once
  first-retry success  of calls refused at first whose SDK tried again, the share admitted at that second try
  goodput            calls completed inside their deadline / run duration
  admitted misses    admitted calls that did not complete inside their deadline / admitted calls
  compiles           completed calls whose replica compiled their response_format first (not cached), and how long
Each figure can be taken over one kind of call alone (summarize_by_kind): plain, chat, constrained, chat_constrained.
Percentiles are nearest-rank: the smallest value with at least p% of the values at or below it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum

from .templates import KINDS

# a run whose scheduler fired a request later than this is flagged: the load generator's host fell behind
LAG_WARNING_MS = 50.0

OVERLOADED = "RESOURCE_EXHAUSTED"


class TraceOutcome(StrEnum):
    """How a planned request ended, as the load tester saw it: not the ledger's billing.records.Outcome (a refused
    call is never billed; a call never sent is not a call)."""

    PENDING = "pending"
    OK = "ok"
    REJECTED = "rejected"
    QUOTA = "quota_exceeded"  # the tenant is at a cap (calls per second, device time or spend per month)
    INFEASIBLE = "infeasible"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNAVAILABLE = "unavailable"
    ERROR = "error"
    NOT_SENT = "not_sent"


@dataclass
class RequestTrace:
    index: int
    planned_s: float
    deadline_ms: float
    prompt_tokens: int
    max_tokens: int
    sent_s: float | None = None
    outcome: TraceOutcome = TraceOutcome.PENDING
    error: str = ""
    attempts: list[tuple[float, str]] = field(default_factory=list)  # (start_s, "admitted" or a code name)
    attempt_endpoints: list[str] = field(default_factory=list)
    first_token_s: float | None = None
    finished_s: float | None = None
    completion_tokens: int = 0
    device_us: int | None = None  # the usage the final message reported
    server_deadline_met: bool | None = None
    server_queue_us: int | None = None
    server_total_us: int | None = None  # the replica's own received -> finished (Final.timings)
    final_lag_us: int | None = None  # engine finish -> this client read the final message
    # (epoch clocks of both hosts: exact on one host)
    endpoint: str = ""
    retry_after_ms: int | None = None  # a failed call's last hint (Rejected: when to come back)
    refusal_cause: str = ""  # a refused call's last refusal: why not now (ErrorInfo metadata "cause")
    kind: str = "plain"  # plain, chat, constrained or chat_constrained (templates.py)
    compile_us: int | None = None  # an admitted call's response_format compile (Admission.compile_us; 0: cached)
    finish_reason: str = ""  # a completed call's: stop, or length (a constrained output cut short)

    @property
    def admitted_s(self) -> float | None:
        return next((t for t, outcome in self.attempts if outcome == "admitted"), None)

    @property
    def num_rejections(self) -> int:
        return sum(1 for _, outcome in self.attempts if outcome == OVERLOADED)

    @property
    def in_deadline(self) -> bool:
        """Completed, and inside the caller's deadline by both the client's and the server's clocks."""
        return (
            self.outcome == TraceOutcome.OK
            and self.finished_s is not None
            and self.sent_s is not None
            and self.finished_s - self.sent_s <= self.deadline_ms / 1000
            and self.server_deadline_met is not False
        )


@dataclass(frozen=True)
class Percentiles:
    p50: float | None
    p95: float | None
    p99: float | None
    max: float | None
    count: int


def percentile(values: Sequence[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(math.ceil(p / 100 * len(ordered)), 1)
    return ordered[rank - 1]


def percentiles(values: Sequence[float]) -> Percentiles:
    return Percentiles(
        percentile(values, 50),
        percentile(values, 95),
        percentile(values, 99),
        max(values) if values else None,
        len(values),
    )


def ratio(num: float, den: float) -> float | None:
    return num / den if den else None


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_sent: int
    num_admitted: int
    num_completed: int
    num_in_deadline: int
    outcomes: dict[str, int]
    latency_ms: Percentiles
    admitted_latency_ms: Percentiles
    ttft_ms: Percentiles
    admitted_ttft_ms: Percentiles
    p99_over_p50: float | None  # admitted latency
    server_latency_ms: Percentiles  # the replica's received -> finished of completed calls: the
    server_p99_over_p50: float | None  # spread without the load generator's own delays on shared cores
    final_lag_ms: Percentiles  # engine finish -> final read: the usage commit, the relay,
    # gRPC and the load generator's own loop
    rejection_rate: float | None
    attempt_rejection_rate: float | None  # refused attempts / attempts
    avg_retries_per_rejected: float | None
    first_retry_success_rate: float | None
    goodput_rps: float
    admitted_miss_rate: float | None
    num_admitted_misses: int
    mean_completion_tokens: float | None
    max_dispatch_lag_ms: float | None  # how late the scheduler fired, worst case
    duration_s: float
    num_stopped: int = 0  # completed calls that ended with finish_reason stop (a constrained output whole)
    compile_ms: Percentiles = Percentiles(None, None, None, None, 0)  # completed calls that waited for a compile

    def to_dict(self) -> dict:
        return asdict(self)


def _ms(values) -> list[float]:
    return [v * 1000 for v in values]


def summarize(traces: Sequence[RequestTrace], duration_s: float) -> Summary:
    sent = [t for t in traces if t.sent_s is not None]
    done = [t for t in sent if t.outcome == TraceOutcome.OK and t.finished_s is not None]
    admitted = [t for t in sent if t.admitted_s is not None]
    in_deadline = [t for t in sent if t.in_deadline]
    refused_first = [t for t in sent if t.attempts and t.attempts[0][1] == OVERLOADED]
    refused_any = [t for t in sent if t.num_rejections]
    retried = [t for t in refused_first if len(t.attempts) >= 2]
    num_attempts = sum(len(t.attempts) for t in sent)
    latency = _ms(t.finished_s - t.sent_s for t in done)
    admitted_latency = _ms(t.finished_s - t.admitted_s for t in done if t.admitted_s is not None)
    ttft = _ms(t.first_token_s - t.sent_s for t in done if t.first_token_s is not None)
    admitted_ttft = _ms(
        t.first_token_s - t.admitted_s for t in done if t.first_token_s is not None and t.admitted_s is not None
    )
    admitted_pct = percentiles(admitted_latency)
    server_pct = percentiles([t.server_total_us / 1000 for t in done if t.server_total_us is not None])
    lags = _ms(t.sent_s - t.planned_s for t in sent)
    return Summary(
        num_requests=len(traces),
        num_sent=len(sent),
        num_admitted=len(admitted),
        num_completed=len(done),
        num_in_deadline=len(in_deadline),
        outcomes=dict(Counter(t.outcome for t in traces)),
        latency_ms=percentiles(latency),
        admitted_latency_ms=admitted_pct,
        ttft_ms=percentiles(ttft),
        admitted_ttft_ms=percentiles(admitted_ttft),
        p99_over_p50=ratio(admitted_pct.p99, admitted_pct.p50) if admitted_pct.count else None,
        server_latency_ms=server_pct,
        server_p99_over_p50=ratio(server_pct.p99, server_pct.p50) if server_pct.count else None,
        final_lag_ms=percentiles([t.final_lag_us / 1000 for t in done if t.final_lag_us is not None]),
        rejection_rate=ratio(len(refused_first), len(sent)),
        attempt_rejection_rate=ratio(sum(t.num_rejections for t in sent), num_attempts),
        avg_retries_per_rejected=ratio(sum(len(t.attempts) - 1 for t in refused_any), len(refused_any)),
        first_retry_success_rate=ratio(sum(1 for t in retried if t.attempts[1][1] == "admitted"), len(retried)),
        goodput_rps=len(in_deadline) / duration_s,
        admitted_miss_rate=ratio(sum(1 for t in admitted if not t.in_deadline), len(admitted)),
        num_admitted_misses=sum(1 for t in admitted if not t.in_deadline),
        mean_completion_tokens=ratio(sum(t.completion_tokens for t in done), len(done)),
        max_dispatch_lag_ms=max(lags) if lags else None,
        duration_s=duration_s,
        num_stopped=sum(1 for t in done if t.finish_reason == "stop"),
        compile_ms=percentiles([t.compile_us / 1000 for t in done if t.compile_us]),
    )


def summarize_by_kind(traces: Sequence[RequestTrace], duration_s: float) -> dict[str, Summary]:
    """A summary per kind of call (plain, chat, constrained, chat_constrained) over the same run duration, so each
    kind's goodput is its own share of the run's; kinds no call had are left out."""
    kinds: dict[str, list[RequestTrace]] = {}
    for t in traces:
        kinds.setdefault(t.kind, []).append(t)
    ordered = sorted(kinds, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k))
    return {kind: summarize(kinds[kind], duration_s) for kind in ordered}


def time_series(traces: Sequence[RequestTrace], duration_s: float, bin_s: float = 0.5) -> dict[str, list]:
    """Counts per bin of arrivals (planned), admissions, rejections (refused attempts) and completions,
    from 0 until the last thing that happened."""
    horizon_s = max([duration_s, *(t.finished_s for t in traces if t.finished_s is not None)])
    num_bins = int(horizon_s // bin_s) + 1  # an event at the horizon gets its own bin
    series: dict[str, list] = {name: [0] * num_bins for name in ("arrivals", "admissions", "rejections", "completions")}

    def add(name: str, t: float) -> None:
        series[name][min(max(int(t // bin_s), 0), num_bins - 1)] += 1

    for t in traces:
        add("arrivals", t.planned_s)
        for at, outcome in t.attempts:
            if outcome == "admitted":
                add("admissions", at)
            elif outcome == OVERLOADED:
                add("rejections", at)
        if t.outcome == TraceOutcome.OK and t.finished_s is not None:
            add("completions", t.finished_s)
    series["bin_start_s"] = [i * bin_s for i in range(num_bins)]
    return series
