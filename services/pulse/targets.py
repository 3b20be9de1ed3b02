"""The replicas a pulse runs against, and one open-loop run against one of them through one of its doors (gRPC, the
SDK's; or HTTP, OpenAI's /v1/completions): shared by cli.py (a run, a compare, doors side by side) and capacity.py
(the saturation run and the knee's probes). Imports neither of them."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from services.client.retry import RetryConfig

from .stats import LAG_WARNING_MS

DOORS = ("grpc", "http")
HTTP_NOTE = (
    "the HTTP door answers whole (stream false): no TTFT; the latency at the replica and finish → read come from its "
    "x-received-at-us and x-finished-at-us"
)

if TYPE_CHECKING:
    from .replicas import ReplicaProcess


@dataclass
class Target:
    label: str
    endpoints: list[str]
    metrics_urls: list[str] = field(default_factory=list)
    api_key: str | None = None
    admission: str = "deadline"  # the mode of a replica the tool starts when no endpoints are given
    tls_ca: str | None = None
    max_attempts: int = RetryConfig.max_attempts  # a call's attempts, the first included (1: no retries)
    replica: ReplicaProcess | None = None  # when the tool started the replica (it can create tenants there)
    http_urls: list[str] = field(default_factory=list)  # the replicas' HTTP doors, as http://host:port
    doors: tuple[str, ...] = ("grpc",)  # the doors a run goes through, one after the other
    door: str = "grpc"  # the one client() calls through
    max_connections: int = 100  # the HTTP client's pool: the calls open at once

    @property
    def run_label(self) -> str:
        """The label of a run through `door`: the target's, and the door's when not gRPC alone."""
        return self.label if self.doors == ("grpc",) else f"{self.label}-{self.door}"

    def through(self, door: str) -> Target:
        return replace(self, door=door)

    def client(self):
        """The client of this target's door: the SDK's AsyncClient (gRPC) or an HttpClient."""
        if self.door != "http":
            return self.grpc_client()
        import ssl

        from .http_client import HttpClient

        verify = ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else True
        retry = RetryConfig(max_attempts=self.max_attempts)
        return HttpClient(
            self.http_urls, self.api_key, retry=retry, max_connections=self.max_connections, verify=verify
        )

    def grpc_client(self):
        import grpc

        from services.client import AsyncClient

        tls = grpc.ssl_channel_credentials(Path(self.tls_ca).read_bytes()) if self.tls_ca else False
        return AsyncClient(self.endpoints, self.api_key, tls, retry=RetryConfig(max_attempts=self.max_attempts))


def doors_of(args: argparse.Namespace) -> tuple[str, ...]:
    """--doors, else http alone with --http, else gRPC alone."""
    doors = tuple(getattr(args, "doors", None) or (("http",) if getattr(args, "http", False) else ("grpc",)))
    if getattr(args, "http", False) and "http" not in doors:
        raise SystemExit("zeroqueue pulse: error: --http and --doors without http disagree")
    return doors


def targets_from(args: argparse.Namespace) -> list[Target]:
    """The targets `zeroqueue pulse`'s arguments name: deadline then fifo with --compare, else one; each goes
    through the doors --doors (or --http) names, calling through the first."""
    doors = doors_of(args)
    common = dict(
        api_key=args.api_key,
        tls_ca=args.tls_ca,
        max_attempts=args.max_attempts,
        doors=doors,
        door=doors[0],
        max_connections=args.max_in_flight,
    )
    if args.compare:
        return [
            Target(
                mode,
                getattr(args, f"{mode}_endpoint"),
                getattr(args, f"{mode}_metrics_url"),
                admission=mode,
                http_urls=getattr(args, f"{mode}_http_endpoint", []),
                **common,
            )
            for mode in ("deadline", "fifo")
        ]
    label = "run" if args.endpoint or getattr(args, "http_endpoint", []) else args.admission
    http_urls = getattr(args, "http_endpoint", [])
    return [Target(label, args.endpoint, args.metrics_url, admission=args.admission, http_urls=http_urls, **common)]


def _check_named(target: Target, need_key: bool) -> None:
    """A target whose replicas are named names what its doors need: a key, gRPC endpoints (pulse reads the model's
    context and vocabulary through ListModels), and HTTP endpoints for the HTTP door."""
    if need_key and not target.api_key:
        raise SystemExit("zeroqueue pulse: error: --api-key (or $ZEROQUEUE_API_KEY) is needed with endpoints")
    if not target.endpoints:
        raise SystemExit(
            "zeroqueue pulse: error: --http-endpoint needs --endpoint too (the same replica's gRPC address: pulse "
            "reads the model's context and vocabulary through ListModels)"
        )
    if "http" in target.doors and not target.http_urls:
        raise SystemExit("zeroqueue pulse: error: the HTTP door of named replicas needs --http-endpoint URL")


@contextlib.contextmanager
def opened(target: Target, args: argparse.Namespace, out_dir: Path, console, need_key: bool = True) -> Iterator[Target]:
    """The target itself if it names endpoints; otherwise a replica started for it, stopped afterwards.
    `need_key` False: the callers bring their own keys (tenants)."""
    if target.endpoints or target.http_urls:
        _check_named(target, need_key)
        yield target
        return
    from services.inference.bundled_model import default_model

    from .replicas import start_replica

    model = Path(args.model) if args.model else default_model()
    console.print(f"starting a {target.admission}-mode replica on {model} (warm-up and calibration first) ...")
    http = "http" in target.doors
    replica = start_replica(model, target.admission, out_dir, shlex.split(args.serve_args), http=http)
    door = f", HTTP {replica.http_url}" if http else ""
    console.print(f"  SERVING on {replica.address}{door}, metrics {replica.metrics_url}, log {replica.log_path}")
    try:
        yield replace(
            target,
            endpoints=[replica.address],
            metrics_urls=[replica.metrics_url],
            api_key=replica.api_key,
            tls_ca=None,
            replica=replica,
            http_urls=[replica.http_url] if http else [],
        )
    finally:
        replica.stop()


def scrape_all(urls: list[str]) -> list:
    """Each URL's /metrics samples, or None where it did not answer."""
    from .scrape import scrape

    out = []
    for url in urls:
        try:
            out.append(scrape(url))
        except OSError:
            out.append(None)
    return out


def server_view_between(before: list, after: list) -> dict | None:
    """The replicas' view of what happened between two `scrape_all`s, summed over the replicas that answered
    both times; None if none did."""
    from .scrape import delta, server_view

    total: dict = {}
    pairs = [(b, a) for b, a in zip(before, after, strict=True) if b is not None and a is not None]
    for b, a in pairs:
        for key, value in delta(a, b).items():
            total[key] = total.get(key, 0.0) + value
    return server_view({}, total) if pairs else None


async def model_info(target: Target):
    """The first model the target's first endpoint serves (ListModels, over gRPC whatever the door)."""
    async with target.grpc_client() as client:
        (model, *_) = await client.list_models(timeout_s=30)
        return model


async def _drive(target: Target, requests, prefix: str, args: argparse.Namespace, console) -> list:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .runner import run_plan

    counts: Counter = Counter()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[stats]}"),
    )
    with Progress(*columns, console=console, disable=args.no_progress) as progress:
        task = progress.add_task(f"{target.run_label}: sent", total=len(requests), stats="")

        def on_done(trace) -> None:
            counts[trace.outcome] += 1
            progress.update(task, stats=" ".join(f"{k}={v}" for k, v in sorted(counts.items())))

        async with target.client() as client:
            return await run_plan(
                client, requests, prefix, lambda t: progress.advance(task), on_done, args.max_in_flight
            )


def pulse_one(target: Target, args: argparse.Namespace, load, shape_args: dict, run_id: str, console):
    """One open-loop run of `load` against an opened target, through its door: its summary, traces and the
    replicas' view."""
    from .report import RunReport
    from .schedule import ShapeSpec, plan
    from .stats import summarize, summarize_by_kind
    from .templates import check_served, templates_of

    model = asyncio.run(model_info(target))
    shape = ShapeSpec(**shape_args, context_length=model.context_length)
    templates = templates_of(args)
    try:
        check_served(templates, model)
    except ValueError as error:
        raise SystemExit(f"zeroqueue pulse: error: {error}") from None
    requests = plan(load, shape, model.vocab_size, args.deadline_ms, args.deadline_per_token_ms, templates=templates)
    before = scrape_all(target.metrics_urls)
    traces = asyncio.run(_drive(target, requests, f"pulse-{run_id}-{target.run_label}", args, console))
    time.sleep(0.5)  # the last calls' metrics settle
    server = server_view_between(before, scrape_all(target.metrics_urls))
    notes = [] if server or not target.metrics_urls else ["/metrics was unreachable: no server-side figures"]
    if target.door == "http":
        notes.append(HTTP_NOTE)
    summary = summarize(traces, load.duration_s)
    if (summary.max_dispatch_lag_ms or 0) > LAG_WARNING_MS:
        notes.append(
            f"the load generator sent some requests up to {summary.max_dispatch_lag_ms:.0f} ms late: this "
            "machine could not keep the schedule, so arrivals bunched up (see scheduler lag)"
        )
    endpoints = target.http_urls if target.door == "http" else target.endpoints
    by_kind = summarize_by_kind(traces, load.duration_s)
    return RunReport(
        target.run_label, endpoints, summary, traces, server, notes, by_kind, door=target.door, mode=target.label
    )
