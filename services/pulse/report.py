"""A pulse run's outputs: the rich table (runs side by side; with several kinds of call, a second one with each kind
of each run side by side; with several doors, one with a row per door and mode), the JSON file, per-request traces,
PNG plots."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .stats import RequestTrace, Summary, TraceOutcome, time_series
from .templates import KINDS


@dataclass
class RunReport:
    label: str  # e.g. "deadline", "fifo"
    endpoints: list[str]
    summary: Summary
    traces: list[RequestTrace]
    server: dict | None = None  # scrape.server_view, when /metrics was reachable
    notes: list[str] = field(default_factory=list)
    by_kind: dict[str, Summary] = field(default_factory=dict)  # stats.summarize_by_kind of the traces
    door: str = "grpc"  # what the calls went through: grpc (the SDK) or http (the replica's HTTP door)
    mode: str = ""  # the target's label without the door (e.g. deadline), for the doors' table


def number(value, fmt: str = "{:.1f}") -> str:
    return "—" if value is None else fmt.format(value)


def percent(value) -> str:
    return number(None if value is None else value * 100, "{:.2f} %")


def _p(p, attr: str) -> str:
    return number(getattr(p, attr))


def rows(run: RunReport) -> list[tuple[str, str]]:
    s, server = run.summary, run.server or {}
    queue, step, waited = server.get("queue_time", {}), server.get("step_time", {}), server.get("steps_waited", {})
    out = [("requests sent / completed / in deadline", f"{s.num_sent} / {s.num_completed} / {s.num_in_deadline}")]
    for name, p in (("latency", s.latency_ms), ("admitted latency", s.admitted_latency_ms), ("TTFT", s.ttft_ms)):
        out.append((f"{name} P50 / P95 / P99 / max, ms", " / ".join(_p(p, a) for a in ("p50", "p95", "p99", "max"))))
    out += [
        ("P99 / P50 (admitted latency)", number(s.p99_over_p50, "{:.2f}")),
        (
            "at the replica: latency P50 / P99, ms; P99 / P50",
            f"{_p(s.server_latency_ms, 'p50')} / {_p(s.server_latency_ms, 'p99')}; "
            f"{number(s.server_p99_over_p50, '{:.2f}')}",
        ),
        (
            "engine finish → final read by the client, P50 / P99, ms",
            f"{_p(s.final_lag_ms, 'p50')} / {_p(s.final_lag_ms, 'p99')}",
        ),
        ("rejection rate (first attempt)", percent(s.rejection_rate)),
        ("refused attempts / attempts", percent(s.attempt_rejection_rate)),
        ("avg retries per rejected request", number(s.avg_retries_per_rejected, "{:.2f}")),
        ("first-retry success", percent(s.first_retry_success_rate)),
        ("goodput, req/s in deadline", number(s.goodput_rps, "{:.2f}")),
        ("deadline misses among admitted", f"{s.num_admitted_misses} ({percent(s.admitted_miss_rate)})"),
        (
            "server queue time mean / P99 ≤, ms",
            f"{number(queue.get('mean_ms'), '{:.2f}')} / {number(queue.get('p99_at_most_ms'), '{:.1f}')}",
        ),
        (
            "server step time / period mean, ms",
            f"{number(step.get('mean_ms'), '{:.2f}')} / "
            f"{number(server.get('step_period', {}).get('mean_ms'), '{:.2f}')}",
        ),
        (
            "joined the very next step / most steps waited ≤",
            f"{percent(waited.get('next_step_share'))} / {number(waited.get('max_at_most'), '{:.0f}')}",
        ),
        ("mean completion tokens", number(s.mean_completion_tokens)),
        ("scheduler lag max, ms", number(s.max_dispatch_lag_ms)),
        ("outcomes", ", ".join(f"{k} {v}" for k, v in sorted(s.outcomes.items()))),
    ]
    return out


def kind_rows(s: Summary) -> list[tuple[str, str]]:
    """One kind of call's figures: what to set beside the same run's plain calls (and a plain run's)."""
    admitted, compiles = s.admitted_latency_ms, s.compile_ms
    attainment = None if s.admitted_miss_rate is None else 1 - s.admitted_miss_rate
    return [
        ("sent / completed / in deadline", f"{s.num_sent} / {s.num_completed} / {s.num_in_deadline}"),
        ("goodput, req/s", number(s.goodput_rps, "{:.2f}")),
        ("attainment of admitted", percent(attainment)),
        ("refused at first attempt", percent(s.rejection_rate)),
        ("admitted P50 / P99, ms", f"{_p(admitted, 'p50')} / {_p(admitted, 'p99')}"),
        ("TTFT P50 / P99, ms", f"{_p(s.ttft_ms, 'p50')} / {_p(s.ttft_ms, 'p99')}"),
        ("ended stop / length", f"{s.num_stopped} / {s.num_completed - s.num_stopped}"),
        ("compiles; P50 / max, ms", f"{compiles.count}; {_p(compiles, 'p50')} / {_p(compiles, 'max')}"),
        ("mean output tokens", number(s.mean_completion_tokens)),
        ("outcomes", ", ".join(f"{k} {v}" for k, v in sorted(s.outcomes.items()))),
    ]


def print_kind_table(runs: Sequence[RunReport], console: Console) -> None:
    """When a run had more than plain calls: each kind of call, the runs' side by side (deadline beside fifo)."""
    if all(set(run.by_kind) <= {"plain"} for run in runs):
        return
    table = Table(title="by kind of call (goodput: the kind's calls in deadline per second of the run)")
    table.add_column("metric")
    kinds = [kind for kind in KINDS if any(kind in run.by_kind for run in runs)]
    cells = [
        (f"{run.label}: {kind}", dict(kind_rows(run.by_kind[kind])) if kind in run.by_kind else {})
        for kind in kinds
        for run in runs
    ]
    for header, _ in cells:
        table.add_column(header, justify="right")
    for name, _ in kind_rows(runs[0].summary):
        table.add_row(name, *(cell.get(name, "—") for _, cell in cells))
    console.print(table)


def _pct(value) -> str:
    return number(None if value is None else value * 100, "{:.1f}%")


def _pair(a, b, fmt: str = "{:.0f}") -> str:
    return f"{number(a, fmt)} / {number(b, fmt)}"


def door_row(run: RunReport) -> list[tuple[str, str]]:
    """One run's figures in the doors' table, (column header, value): what to set beside the other door's."""
    s, server = run.summary, run.server or {}
    queue, step = server.get("queue_time", {}), server.get("step_time", {})
    attainment = None if s.admitted_miss_rate is None else 1 - s.admitted_miss_rate
    return [
        ("mode", run.mode or run.label),
        ("door", run.door),
        ("goodput\nreq/s", number(s.goodput_rps, "{:.2f}")),
        ("attain-\nment", _pct(attainment)),
        ("refused", _pct(s.rejection_rate)),
        ("retries/\nrefused", number(s.avg_retries_per_rejected, "{:.2f}")),
        ("1st retry\nadmitted", _pct(s.first_retry_success_rate)),
        ("admitted\nP50 / P99", _pair(s.admitted_latency_ms.p50, s.admitted_latency_ms.p99)),
        ("replica\nP50 / P99", _pair(s.server_latency_ms.p50, s.server_latency_ms.p99)),
        ("queue mean\n/ P99 ≤", _pair(queue.get("mean_ms"), queue.get("p99_at_most_ms"), "{:.1f}")),
        ("step\nmean", number(step.get("mean_ms"), "{:.1f}")),
    ]


DOOR_CAPTION = (
    "goodput: calls done in their deadline per second; attainment: the share of admitted calls done in their deadline; "
    "refused: the share of calls whose first attempt was; retries per refused call and the first retry's success as "
    "the SDK made them; latencies in ms, of admitted calls from their admitted attempt; replica: its own latency "
    "(gRPC's Final.timings); queue and step: the replica's mean times (/metrics)"
)


def print_door_table(runs: Sequence[RunReport], title: str, console: Console) -> None:
    """The runs as rows, a row per door and mode: the same schedule through gRPC and through HTTP, side by side."""
    table = Table(title=title, caption=DOOR_CAPTION, show_edge=False)
    cells = [door_row(run) for run in runs]
    for name, _ in cells[0]:
        table.add_column(name, justify="left" if name in ("mode", "door") else "right", no_wrap=True)
    for row in cells:
        table.add_row(*(value for _, value in row))
    console.print(table)


def print_table(runs: Sequence[RunReport], title: str, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=title)
    table.add_column("metric")
    for run in runs:
        table.add_column(run.label, justify="right")
    per_run = [dict(rows(run)) for run in runs]
    for name, _ in rows(runs[0]):
        table.add_row(name, *(r[name] for r in per_run))
    console.print(table)
    print_kind_table(runs, console)
    for run in runs:
        for note in run.notes:
            console.print(f"[yellow]{run.label}: {note}[/yellow]")


def write_json(path: Path, runs: Sequence[RunReport], config: dict) -> None:
    doc = {
        "tool": "zeroqueue pulse",
        "config": config,
        "runs": {
            run.label: {
                "door": run.door,
                "endpoints": run.endpoints,
                "summary": run.summary.to_dict(),
                "by_kind": {kind: s.to_dict() for kind, s in run.by_kind.items()},
                "server": run.server,
                "notes": run.notes,
                "time_series": time_series(run.traces, run.summary.duration_s),
            }
            for run in runs
        },
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def write_traces(out_dir: Path, runs: Sequence[RunReport]) -> None:
    for run in runs:
        with open(out_dir / f"trace-{run.label}.jsonl", "w") as f:
            for t in run.traces:
                f.write(json.dumps(dataclasses.asdict(t)) + "\n")


def _axes(num_runs: int, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, num_runs, figsize=(6 * num_runs, 4.5), squeeze=False, sharey=True)
    fig.suptitle(title)
    return plt, fig, axes[0]


def plot(out_dir: Path, runs: Sequence[RunReport]) -> list[Path]:
    """latency.png, scatter.png, timeseries.png: one panel per run, side by side."""
    written = []
    plt, fig, axes = _axes(len(runs), "End-to-end latency of completed requests")
    for ax, run in zip(axes, runs, strict=True):
        done = [t for t in run.traces if t.outcome == TraceOutcome.OK]
        ax.hist([(t.finished_s - t.sent_s) * 1000 for t in done], bins=40, alpha=0.6, label="call")
        ax.hist(
            [(t.finished_s - t.admitted_s) * 1000 for t in done if t.admitted_s is not None],
            bins=40,
            alpha=0.6,
            label="admitted attempt",
        )
        deadlines = {t.deadline_ms for t in run.traces}
        if len(deadlines) == 1:
            ax.axvline(deadlines.pop(), color="red", linestyle="--", label="deadline")
        ax.set(title=run.label, xlabel="ms", ylabel="requests")
        ax.legend()
    written.append(_save(plt, fig, out_dir / "latency.png"))

    plt, fig, axes = _axes(
        len(runs),
        "Dispatch (admitted attempt sent; never admitted: first attempt) vs finish "
        "per request: a thin band along y = x means nothing queued",
    )
    colors = {
        TraceOutcome.OK: "tab:green",
        TraceOutcome.REJECTED: "tab:orange",
        TraceOutcome.DEADLINE_EXCEEDED: "tab:red",
    }
    for ax, run in zip(axes, runs, strict=True):
        for outcome in sorted({t.outcome for t in run.traces}):
            pts = [
                (t.admitted_s if t.admitted_s is not None else t.sent_s, t.finished_s)
                for t in run.traces
                if t.outcome == outcome and t.finished_s is not None
            ]
            if pts:
                ax.scatter(*zip(*pts, strict=True), s=6, label=outcome, color=colors.get(outcome, "tab:gray"))
        top = max((t.finished_s or 0 for t in run.traces), default=1)
        ax.plot([0, top], [0, top], color="black", linewidth=0.5)
        ax.set(title=run.label, xlabel="dispatched at, s", ylabel="finished at, s")
        ax.legend(markerscale=3)
    written.append(_save(plt, fig, out_dir / "scatter.png"))

    plt, fig, axes = _axes(len(runs), "Arrivals, admissions, rejections and completions per 0.5 s")
    for ax, run in zip(axes, runs, strict=True):
        series = time_series(run.traces, run.summary.duration_s)
        edges = [*series["bin_start_s"], series["bin_start_s"][-1] + 0.5]
        for name, style in (("arrivals", ":"), ("admissions", "-"), ("rejections", "-"), ("completions", "--")):
            ax.stairs(series[name], edges, label=name, linestyle=style, linewidth=1.5)
        ax.set(title=run.label, xlabel="s", ylabel="count per bin")
        ax.legend()
    written.append(_save(plt, fig, out_dir / "timeseries.png"))
    return written


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
