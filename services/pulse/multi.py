"""`zeroqueue pulse --tenant ... --tenant ...`: several tenants' open-loop traffic at once against each target,
and with --alone, one tenant's same schedule sent on its own first, so its goodput beside the others can be set
against its goodput alone.

    zeroqueue pulse --tenant name=A,load=4 --tenant name=B,load=0.4 --alone B \\
        --capacity-json out/capacity/capacity.json --duration 30 --compare

Every tenant's calls go through its own SDK client (its own key) from one event loop; a replica the tool starts
gets a tenant of each keyless --tenant's name.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from .schedule import LoadSpec, PlannedRequest, ShapeSpec, plan
from .stats import LAG_WARNING_MS, RequestTrace
from .targets import Target, model_info, opened, scrape_all, server_view_between, targets_from
from .templates import check_served, describe_mix, templates_of
from .tenant_stats import TenantFigures, TogetherRun, tenant_figures, together
from .tenants import TenantSpec, check_tenants

SETTLE_S = 3.0  # between the alone run and the run together: the replica forgets who was active (half-life 2 s)


def _capacity_qps(args: argparse.Namespace) -> float | None:
    return json.loads(Path(args.capacity_json).read_text())["capacity_qps"] if args.capacity_json else None


def tenant_keys(target: Target, specs: Sequence[TenantSpec]) -> dict[str, str]:
    """Each tenant's key: its own, or one made in the replica the tool started."""
    keys = {}
    for spec in specs:
        if spec.api_key:
            keys[spec.name] = spec.api_key
        elif target.replica is not None:
            keys[spec.name] = target.replica.create_tenant(spec.name)
        else:  # check_tenants refuses this before anything starts
            raise ValueError(f"--tenant {spec.name}: field key is needed with --endpoint")
    return keys


def tenant_plans(
    specs: Sequence[TenantSpec], rates: Mapping[str, float], args: argparse.Namespace, shape: ShapeSpec, vocab: int
) -> dict[str, list[PlannedRequest]]:
    """Each tenant's schedule: its own rate and seed (default --seed + its position), the shared shape."""
    plans = {}
    for i, spec in enumerate(specs):
        load = LoadSpec(
            rates[spec.name],
            args.duration,
            args.arrival,
            args.pulse_factor,
            args.pulse_seconds,
            args.pulse_every,
            spec.seed_or(args.seed + i),
        )
        deadline_ms = spec.deadline_ms or args.deadline_ms
        plans[spec.name] = plan(
            load,
            shape,
            vocab,
            deadline_ms,
            args.deadline_per_token_ms,
            service_class=spec.service_class,
            templates=templates_of(args),
        )
    return plans


async def _drive(
    target: Target, plans: Mapping[str, list[PlannedRequest]], keys: Mapping[str, str], prefix: str, args, console
) -> dict[str, list[RequestTrace]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .runner import run_plan

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=args.no_progress) as progress:
        async with contextlib.AsyncExitStack() as stack:
            runs = []
            for name, requests in plans.items():
                client = await stack.enter_async_context(replace(target, api_key=keys[name]).client())
                task = progress.add_task(f"{target.label} {name}: sent", total=len(requests))
                on_sent = lambda t, task=task: progress.advance(task)  # noqa: E731 - one per tenant
                runs.append(run_plan(client, requests, f"{prefix}-{name}", on_sent, max_in_flight=args.max_in_flight))
            results = await asyncio.gather(*runs)
    return dict(zip(plans, results, strict=True))


async def _measure(target: Target, plans, keys, prefix: str, args, console) -> tuple[dict, dict | None]:
    """One run of `plans` at once: the traces per tenant and the replicas' view over it."""
    before = scrape_all(target.metrics_urls)
    traces = await _drive(target, plans, keys, prefix, args, console)
    await asyncio.sleep(0.5)  # the last calls' metrics settle
    return traces, server_view_between(before, scrape_all(target.metrics_urls))


def _notes(run: TogetherRun, alone: Mapping[str, TenantFigures], target: Target) -> list[str]:
    notes = [] if run.server or not target.metrics_urls else ["/metrics was unreachable: no server-side figures"]
    for figures in (*run.tenants, *alone.values()):
        lag_ms = figures.summary.max_dispatch_lag_ms or 0
        if lag_ms > LAG_WARNING_MS:
            which = f"{figures.tenant} alone" if figures in alone.values() else figures.tenant
            notes.append(f"{which}: the load generator sent some calls up to {lag_ms:.0f} ms late (host too busy)")
    return notes


async def pulse_tenants(
    target: Target,
    specs: Sequence[TenantSpec],
    rates: Mapping[str, float],
    args: argparse.Namespace,
    shape_args: dict,
    run_id: str,
    console,
) -> tuple[TogetherRun, dict[str, list[RequestTrace]]]:
    """Against one opened target: each --alone tenant alone, then every tenant at once. Returns the run and the
    traces (an alone run's under '<name> alone'). One event loop for all of it: gRPC's aio channels outlive none."""
    keys = tenant_keys(target, specs)
    model = await model_info(replace(target, api_key=keys[specs[0].name]))
    try:
        check_served(templates_of(args), model)
    except ValueError as error:
        raise SystemExit(f"zeroqueue pulse: error: {error}") from None
    shape = ShapeSpec(**shape_args, context_length=model.context_length)
    plans = tenant_plans(specs, rates, args, shape, model.vocab_size)
    classes = {spec.name: spec.service_class for spec in specs}
    prefix = f"pulse-{run_id}-{target.label}"
    all_traces: dict[str, list[RequestTrace]] = {}
    alone: dict[str, TenantFigures] = {}
    for name in args.alone:
        console.print(f"{target.label}: {name} alone for {args.duration:.0f} s ...")
        traces, server = await _measure(target, {name: plans[name]}, keys, f"{prefix}-alone", args, console)
        alone[name] = tenant_figures(name, traces[name], args.duration, rates[name], server, classes[name])
        all_traces[f"{name} alone"] = traces[name]
        await asyncio.sleep(SETTLE_S)
    console.print(f"{target.label}: {', '.join(plans)} together for {args.duration:.0f} s ...")
    traces, server = await _measure(target, plans, keys, prefix, args, console)
    all_traces.update(traces)
    run = together(target.label, traces, rates, args.duration, server, classes, alone)
    return replace(run, notes=_notes(run, alone, target)), all_traces


def run_multi_tenant(args: argparse.Namespace, shape_args: dict, out_dir: Path, run_id: str, console) -> int:
    from .tenant_report import print_tenant_table, write_tenant_json, write_tenant_traces

    if args.capacity or args.qps is not None or args.load is not None:
        raise SystemExit("zeroqueue pulse: error: --tenant gives each tenant its rate (qps= or load=): no --qps/--load")
    specs = args.tenant
    capacity_qps = _capacity_qps(args)
    try:
        check_tenants(specs, args.alone, bool(args.endpoint or args.deadline_endpoint or args.fifo_endpoint))
        rates = {spec.name: spec.rate_qps(capacity_qps) for spec in specs}
    except ValueError as error:
        raise SystemExit(f"zeroqueue pulse: error: {error}") from None
    runs, traces = [], {}
    for target in targets_from(args):
        with opened(target, args, out_dir, console, need_key=False) as live:
            run, run_traces = asyncio.run(pulse_tenants(live, specs, rates, args, shape_args, run_id, console))
        runs.append(run)
        traces[run.label] = run_traces
    title = (
        f"pulse, {len(specs)} tenants: "
        + "; ".join(spec.describe(capacity_qps) for spec in specs)
        + f"; {args.arrival}, {args.duration:.0f} s, shape {args.shape} {args.prompt_tokens}+{args.max_tokens}"
        + describe_mix(templates_of(args))
    )
    print_tenant_table(runs, title, console)
    config = {
        "tenants": [
            {
                "name": s.name,
                "qps": rates[s.name],
                "load": s.load,
                "service_class": s.service_class,
                "deadline_ms": s.deadline_ms or args.deadline_ms,
                "seed": s.seed_or(args.seed + i),
            }
            for i, s in enumerate(specs)
        ],
        "alone": list(args.alone),
        "capacity_qps": capacity_qps,
        "duration_s": args.duration,
        "arrival": args.arrival,
        "shape": shape_args,
        "deadline_ms": args.deadline_ms,
        "templates": [t.describe() for t in templates_of(args)],
        "max_attempts": args.max_attempts,
        "seed": args.seed,
        "run_id": run_id,
    }
    write_tenant_json(out_dir / "pulse.json", runs, config)
    write_tenant_traces(out_dir, traces)
    console.print(f"wrote {out_dir / 'pulse.json'} and traces in {out_dir}")
    return 0
