"""What each tenant of a multi-tenant pulse got, from its traces and the replica's metrics. Pure: tests feed it
synthetic traces and scrapes.

Per tenant (the definitions of stats.py, over that tenant's calls only):
  admitted share      calls admitted at some attempt / calls sent
  in deadline         admitted calls completed inside their deadline / admitted calls
  goodput             calls completed inside their deadline / run duration (req/s)
  goodput vs alone    goodput beside the others / goodput of the same schedule sent alone
  refused in the end  calls that ended refused, by the cause of their last refusal (the client's view)
  replica refusals    refused attempts, by cause, as the replica counted them (zeroqueue_refusals_total{tenant})
Causes are grouped by kind: overload (slots_full, step_budget, deadline, delays_admitted: the replica is full;
compiles: it is compiling as many new response_format grammars as it compiles at once; kv_blocks: its KV cache
lacks the blocks until running calls end),
share (over_share: the tenant holds its fair share), priority (a higher class took the room), quota (a cap on
the tenant), infeasible (no idle replica could finish in the budget).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .stats import RequestTrace, Summary, TraceOutcome, ratio, summarize, summarize_by_kind

CAUSE_KINDS = {
    "overload": ("slots_full", "step_budget", "deadline", "delays_admitted", "compiles", "kv_blocks"),
    "share": ("over_share",),
    "priority": ("priority",),
    "quota": ("quota",),
    "infeasible": ("infeasible",),
}
KIND_OF_CAUSE = {cause: kind for kind, causes in CAUSE_KINDS.items() for cause in causes}


def cause_kind(cause: str) -> str:
    return KIND_OF_CAUSE.get(cause, "other")


def by_kind(causes: Mapping[str, float]) -> dict[str, int]:
    """Counts by cause -> counts by kind, in CAUSE_KINDS' order, kinds with none left out."""
    totals: Counter = Counter()
    for cause, count in causes.items():
        totals[cause_kind(cause)] += int(count)
    return {kind: totals[kind] for kind in (*CAUSE_KINDS, "other") if totals[kind]}


def final_refusals(traces: Iterable[RequestTrace]) -> dict[str, int]:
    """Calls that ended refused, by their last refusal's cause (infeasible calls as such)."""
    causes: Counter = Counter()
    for t in traces:
        if t.outcome == TraceOutcome.REJECTED:
            causes[t.refusal_cause or "unknown"] += 1
        elif t.outcome == TraceOutcome.QUOTA:
            causes["quota"] += 1
        elif t.outcome == TraceOutcome.INFEASIBLE:
            causes["infeasible"] += 1
    return dict(causes)


@dataclass(frozen=True)
class TenantFigures:
    tenant: str
    service_class: str
    offered_qps: float  # the schedule's rate
    summary: Summary
    refused_in_the_end: dict[str, int]
    replica_refusals: dict[str, int] | None = None  # by cause; None: no /metrics
    replica_device_us: dict[str, float] | None = None  # by unit (core_us, sm_us)
    alone: TenantFigures | None = None
    by_kind: dict[str, Summary] = field(default_factory=dict)  # with request templates: each kind's summary

    @property
    def admitted_share(self) -> float | None:
        return ratio(self.summary.num_admitted, self.summary.num_sent)

    @property
    def in_deadline_of_admitted(self) -> float | None:
        s = self.summary
        return ratio(s.num_admitted - s.num_admitted_misses, s.num_admitted)

    @property
    def goodput_rps(self) -> float:
        return self.summary.goodput_rps

    @property
    def goodput_vs_alone(self) -> float | None:
        return None if self.alone is None else ratio(self.goodput_rps, self.alone.goodput_rps)

    @property
    def replica_refusals_by_kind(self) -> dict[str, int] | None:
        return None if self.replica_refusals is None else by_kind(self.replica_refusals)

    def to_dict(self) -> dict:
        return {
            "tenant": self.tenant,
            "service_class": self.service_class,
            "offered_qps": self.offered_qps,
            "admitted_share": self.admitted_share,
            "in_deadline_of_admitted": self.in_deadline_of_admitted,
            "goodput_rps": self.goodput_rps,
            "goodput_vs_alone": self.goodput_vs_alone,
            "refused_in_the_end": self.refused_in_the_end,
            "replica_refusals": self.replica_refusals,
            "replica_refusals_by_kind": self.replica_refusals_by_kind,
            "replica_device_us": self.replica_device_us,
            "summary": self.summary.to_dict(),
            "by_kind": {kind: s.to_dict() for kind, s in self.by_kind.items()},
            "alone": None if self.alone is None else self.alone.to_dict(),
        }


def _server_part(server: Mapping | None, key: str, tenant: str) -> dict | None:
    if server is None:
        return None
    return dict(server.get(key, {}).get(tenant, {}))


def tenant_figures(
    tenant: str,
    traces: Sequence[RequestTrace],
    duration_s: float,
    offered_qps: float,
    server: Mapping | None = None,
    service_class: str = "",
    alone: TenantFigures | None = None,
) -> TenantFigures:
    """One tenant's figures; `server` is scrape.server_view's dict over the run (or None)."""
    return TenantFigures(
        tenant,
        service_class,
        offered_qps,
        summarize(traces, duration_s),
        final_refusals(traces),
        _server_part(server, "refusals_by_tenant", tenant),
        _server_part(server, "device_unit_us_by_tenant", tenant),
        alone,
        summarize_by_kind(traces, duration_s),
    )


@dataclass(frozen=True)
class TogetherRun:
    """One replica's run: every tenant's figures side by side, and all of them as one."""

    label: str
    tenants: list[TenantFigures]
    total: TenantFigures
    server: dict | None = None
    notes: list[str] = field(default_factory=list)


def together(
    label: str,
    traces: Mapping[str, Sequence[RequestTrace]],
    specs_qps: Mapping[str, float],
    duration_s: float,
    server: Mapping | None = None,
    classes: Mapping[str, str] | None = None,
    alone: Mapping[str, TenantFigures] | None = None,
) -> TogetherRun:
    """Figures per tenant (`traces` and `specs_qps` keyed by tenant) and for all tenants together."""
    classes, alone = classes or {}, alone or {}
    figures = [
        tenant_figures(name, runs, duration_s, specs_qps[name], server, classes.get(name, ""), alone.get(name))
        for name, runs in traces.items()
    ]
    every = [t for runs in traces.values() for t in runs]
    refusals = device = None
    if server is not None:
        refusals = dict(sum((Counter(f.replica_refusals) for f in figures), Counter()))
        device = dict(sum((Counter(f.replica_device_us) for f in figures), Counter()))
    offered_qps = sum(specs_qps.values())
    total = TenantFigures(
        "all tenants",
        "",
        offered_qps,
        summarize(every, duration_s),
        final_refusals(every),
        refusals,
        device,
        by_kind=summarize_by_kind(every, duration_s),
    )
    return TogetherRun(label, figures, total, dict(server) if server is not None else None)
