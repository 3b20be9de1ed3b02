"""A multi-tenant pulse's outputs: one table with a column per tenant (and alone, and all tenants) of each target,
the JSON file, and per-request traces per tenant."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .report import number, percent
from .stats import RequestTrace
from .tenant_stats import TenantFigures, TogetherRun


def _counts(counts: Mapping[str, float] | None) -> str:
    if counts is None:
        return "—"
    return ", ".join(f"{k} {int(v)}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"


def _device_s(by_unit: Mapping[str, float] | None) -> str:
    if by_unit is None:
        return "—"
    return ", ".join(f"{v / 1e6:.2f} {unit.removesuffix('_us')}·s" for unit, v in sorted(by_unit.items())) or "none"


def _by_kind(f: TenantFigures, figure) -> str:
    return ", ".join(f"{kind} {figure(s)}" for kind, s in f.by_kind.items()) or "—"


def tenant_rows(f: TenantFigures, with_kinds: bool = False) -> list[tuple[str, str]]:
    """A column's rows; `with_kinds` (request templates sent more than plain calls): goodput and attainment of
    each kind of call too."""
    s = f.summary
    kinds = [
        ("goodput by kind, req/s", _by_kind(f, lambda k: number(k.goodput_rps, "{:.2f}"))),
        (
            "in deadline of admitted, by kind",
            _by_kind(f, lambda k: percent(None if k.admitted_miss_rate is None else 1 - k.admitted_miss_rate)),
        ),
    ]
    return [
        ("class", f.service_class or "—"),
        ("offered, req/s (calls planned)", f"{f.offered_qps:.2f} ({s.num_requests})"),
        ("sent / admitted / in deadline", f"{s.num_sent} / {s.num_admitted} / {s.num_in_deadline}"),
        ("admitted, of sent", percent(f.admitted_share)),
        ("in deadline, of admitted", percent(f.in_deadline_of_admitted)),
        ("goodput, req/s in deadline", number(f.goodput_rps, "{:.2f}")),
        ("goodput vs alone", number(f.goodput_vs_alone, "{:.3f}")),
        ("first attempts refused", percent(s.rejection_rate)),
        ("refused in the end, by cause (client)", _counts(f.refused_in_the_end)),
        ("replica: refusals by kind", _counts(f.replica_refusals_by_kind)),
        ("replica: refusals by cause", _counts(f.replica_refusals)),
        ("replica: device time", _device_s(f.replica_device_us)),
        (
            "admitted latency P50 / P99, ms",
            f"{number(s.admitted_latency_ms.p50)} / {number(s.admitted_latency_ms.p99)}",
        ),
        ("scheduler lag max, ms", number(s.max_dispatch_lag_ms)),
        *(kinds if with_kinds else []),
    ]


def columns(run: TogetherRun) -> list[tuple[str, TenantFigures]]:
    """(header, figures): each tenant, then its alone run where there is one, then all tenants."""
    out = []
    for f in run.tenants:
        out.append((f"{run.label}: {f.tenant}", f))
        if f.alone is not None:
            out.append((f"{run.label}: {f.tenant} alone", f.alone))
    out.append((f"{run.label}: all", run.total))
    return out


def print_tenant_table(runs: Sequence[TogetherRun], title: str, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=title)
    table.add_column("metric")
    with_kinds = any(set(f.by_kind) - {"plain"} for run in runs for _, f in columns(run))
    cells = [(header, dict(tenant_rows(f, with_kinds))) for run in runs for header, f in columns(run)]
    for header, _ in cells:
        table.add_column(header, justify="right")
    for name, _ in tenant_rows(runs[0].total, with_kinds):
        table.add_row(name, *(rows[name] for _, rows in cells))
    console.print(table)
    for run in runs:
        for note in run.notes:
            console.print(f"[yellow]{run.label}: {note}[/yellow]")


def write_tenant_json(path: Path, runs: Sequence[TogetherRun], config: dict) -> None:
    doc = {
        "tool": "zeroqueue pulse --tenant",
        "config": config,
        "runs": {
            run.label: {
                "tenants": {f.tenant: f.to_dict() for f in run.tenants},
                "total": run.total.to_dict(),
                "server": run.server,
                "notes": run.notes,
            }
            for run in runs
        },
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def _file_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "tenant"


def write_tenant_traces(out_dir: Path, traces: Mapping[str, Mapping[str, Sequence[RequestTrace]]]) -> None:
    """trace-<label>-<tenant>.jsonl (and -<tenant>-alone), one line per request."""
    for label, per_tenant in traces.items():
        for tenant, runs in per_tenant.items():
            with open(out_dir / f"trace-{_file_part(label)}-{_file_part(tenant)}.jsonl", "w") as f:
                for t in runs:
                    f.write(json.dumps(dataclasses.asdict(t)) + "\n")
