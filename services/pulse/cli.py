"""`zeroqueue pulse`: open-loop load through the SDK, against replicas you name or ones it starts itself.

    zeroqueue pulse --endpoint 127.0.0.1:50051 --api-key KEY --qps 20 --duration 30
    zeroqueue pulse --compare --qps 20 --duration 30            # starts a deadline and a fifo replica in turn
    zeroqueue pulse --capacity --duration 30                    # saturation, then the knee: the capacity
    zeroqueue pulse --compare --load 2 --capacity-json out/capacity/capacity.json --duration 60
    zeroqueue pulse --tenant name=A,load=4 --tenant name=B,load=0.4 --alone B \
        --capacity-json out/capacity/capacity.json --duration 30   # tenants side by side, B also alone
    zeroqueue pulse --compare --qps 8 --templates plain=2,chat=1,json=1   # chat and constrained calls too
    zeroqueue pulse --compare --qps 8 --request-file calls.jsonl        # your own (templates.py says the fields)
    zeroqueue pulse --http --compare --qps 4 --duration 5                # through the replicas' HTTP door
    zeroqueue pulse --doors grpc,http --compare --qps 4 --duration 5     # both doors, a row per door and mode
    zeroqueue pulse --endpoint 127.0.0.1:50051 --http-endpoint http://127.0.0.1:8080 --http --api-key KEY --qps 4

A compare run replays one schedule (same seed) against each mode in turn, one replica at a time, so the
two never share the machine's cores. With several doors, each replica gets the schedule through each door in turn,
in the order --doors gives, a few seconds apart. Tables go to stdout, progress and notes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from services.client.retry import RetryConfig

from .schedule import ARRIVALS
from .targets import DOORS, doors_of
from .templates import BUILT_INS, describe_mix, parse_templates, read_request_file, templates_of
from .tenants import parse_tenant

SETTLE_S = 3.0  # between two doors' runs on one replica: the last calls' metrics settle, the replica goes idle


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _doors(text: str) -> tuple[str, ...]:
    doors = tuple(d.strip() for d in text.split(",") if d.strip())
    unknown = [d for d in doors if d not in DOORS]
    if not doors or unknown or len(set(doors)) != len(doors):
        raise argparse.ArgumentTypeError(f"a list of distinct doors out of {', '.join(DOORS)}, got {text!r}")
    return doors


def _add_doors(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("doors (gRPC, through the SDK; or HTTP, OpenAI's POST /v1/completions)")
    d.add_argument("--http", action="store_true", help="send the schedule through the HTTP door (--doors http)")
    d.add_argument(
        "--doors",
        type=_doors,
        default=None,
        metavar="grpc,http",
        help="the same schedule through each door in turn, against each replica; one table, a row per door and mode",
    )
    d.add_argument("--http-endpoint", action="append", default=[], metavar="URL", help="HTTP door base URL; repeat")
    d.add_argument("--deadline-http-endpoint", action="append", default=[], metavar="URL", help="with --compare")
    d.add_argument("--fifo-http-endpoint", action="append", default=[], metavar="URL", help="with --compare")


def add_pulse(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pulse",
        help="open-loop load test through the SDK (deadline vs fifo with --compare)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _target_options(
        p.add_argument_group("targets (without endpoints, the tool starts `zeroqueue serve` replicas itself)")
    )
    _add_doors(p)
    _load_options(p.add_argument_group("load"))
    _request_options(p.add_argument_group("requests"))
    _capacity_options(p.add_argument_group("capacity"))
    _output_options(p.add_argument_group("output"))
    p.set_defaults(run=run_pulse)


def _target_options(t: argparse._ArgumentGroup) -> None:
    t.add_argument("--endpoint", action="append", default=[], help="replica address; repeat for several")
    t.add_argument("--metrics-url", action="append", default=[], help="a replica's /metrics URL; repeatable")
    t.add_argument("--api-key", default=os.environ.get("ZEROQUEUE_API_KEY"), help="tenant key ($ZEROQUEUE_API_KEY)")
    t.add_argument("--tls-ca", default=None, help="PEM roots to trust: named endpoints serve TLS")
    t.add_argument("--compare", action="store_true", help="run the schedule against deadline mode, then fifo mode")
    t.add_argument("--deadline-endpoint", action="append", default=[])
    t.add_argument("--fifo-endpoint", action="append", default=[])
    t.add_argument("--deadline-metrics-url", action="append", default=[])
    t.add_argument("--fifo-metrics-url", action="append", default=[])
    t.add_argument("--admission", choices=("deadline", "fifo"), default="deadline", help="mode of a started replica")
    t.add_argument("--model", default=None, help="checkpoint for started replicas (default: the bundled model)")
    t.add_argument("--serve-args", default="", help="extra `zeroqueue serve` arguments, e.g. '--max-batch 16'")


def _load_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--qps", type=float, default=None, help="base arrival rate")
    g.add_argument("--load", type=float, default=None, help="base rate as a multiple of --capacity-json's capacity")
    g.add_argument("--capacity-json", default=None, help="capacity.json written by --capacity")
    g.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    g.add_argument(
        "--tenant",
        action="append",
        type=parse_tenant,
        default=[],
        metavar="name=N,(qps=R|load=M),[key=K,class=C,deadline-ms=D,seed=S]",
        help="a tenant with its own key, rate, class and seed; repeat for each (instead of --qps/--load)",
    )
    g.add_argument(
        "--alone",
        action="append",
        default=[],
        metavar="NAME",
        help="with --tenant: first send this tenant's schedule on its own, for its goodput vs alone; repeatable",
    )
    g.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default="poisson",
        help="poisson or constant at the rate (with --pulse-* bursts); burst: qps × --pulse-every calls at once every "
        "--pulse-every s; stages: a ramp up over the first quarter, a plateau, a ramp down over the last",
    )
    g.add_argument("--pulse-factor", type=float, default=1.0, help="rate multiplier inside a burst")
    g.add_argument("--pulse-seconds", type=float, default=0.0, help="burst length (0: no bursts)")
    g.add_argument("--pulse-every", type=float, default=10.0, help="one burst per this many seconds")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-in-flight", type=int, default=10_000)
    g.add_argument(
        "--max-attempts",
        type=_positive_int,
        default=RetryConfig.max_attempts,
        help="attempts per call, the first included, as the SDK makes them (1: no retries)",
    )


def _request_options(s: argparse._ArgumentGroup) -> None:
    s.add_argument("--shape", choices=("fixed", "mix"), default="fixed")
    s.add_argument("--prompt-tokens", type=int, default=64, help="exact (fixed) or median (mix)")
    s.add_argument("--max-tokens", type=int, default=32, help="exact (fixed) or median (mix)")
    s.add_argument("--shape-sigma", type=float, default=0.6, help="mix: log-normal spread")
    s.add_argument("--deadline-ms", type=float, default=2_000.0)
    s.add_argument("--deadline-per-token-ms", type=float, default=0.0, help="added per requested output token")
    s.add_argument(
        "--templates",
        type=parse_templates,
        default=None,
        metavar="NAME[=WEIGHT],...",
        help=f"kinds of call, drawn by weight (seeded): built-ins {', '.join(BUILT_INS)}; plain is the shape's "
        "token ids, chat a conversation for the bundled model, json a JSON Schema and regex a regular expression "
        "(on the shape's token ids), chat_json both. The report splits by kind. E.g. plain=2,chat=1,json=1",
    )
    s.add_argument(
        "--request-file",
        type=read_request_file,
        default=None,
        metavar="FILE",
        help="request templates, one JSON object a line, drawn by weight beside --templates': messages or prompt, "
        "response_format, max_tokens, logprobs, top_logprobs, temperature, deadline_ms, weight (all optional)",
    )


def _capacity_options(c: argparse._ArgumentGroup) -> None:
    c.add_argument(
        "--capacity",
        action="store_true",
        help="measure the fixed shape's saturation (closed loop, --duration) and its capacity: the "
        "highest Poisson rate refusing at most --knee-rejection of first attempts",
    )
    c.add_argument("--concurrency", type=int, default=0, help="closed-loop callers (default: the replica's slots)")
    c.add_argument("--knee-rejection", type=float, default=0.02, help="share of first attempts refused at the knee")
    c.add_argument("--knee-probes", type=int, default=6, help="probe runs of the search for the knee")
    c.add_argument("--probe-duration", type=float, default=20.0, help="seconds of arrivals per probe")
    c.add_argument(
        "--confirm-duration",
        type=float,
        default=60.0,
        help="seconds of each run confirming the knee (as long as the runs at 1x; 0: no confirmation)",
    )
    c.add_argument(
        "--confirm-runs",
        type=int,
        default=3,
        help="confirmation runs: 5 %% lower after one that refused too many, 3 %% higher after one "
        "that refused under --knee-min-rejection",
    )
    c.add_argument(
        "--knee-min-rejection",
        type=float,
        default=0.005,
        help="a confirmation run refusing less than this share tries a higher rate (issue 5's band: 0.5-3 %% at 1x)",
    )


def _output_options(o: argparse._ArgumentGroup) -> None:
    o.add_argument("--out", default=None, help="output directory (default pulse-results/<time>)")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")


def _load_qps(args: argparse.Namespace) -> float:
    if args.load is not None:
        if not args.capacity_json:
            raise SystemExit("zeroqueue pulse: error: --load needs --capacity-json (written by --capacity)")
        return args.load * json.loads(Path(args.capacity_json).read_text())["capacity_qps"]
    if args.qps is None:
        raise SystemExit("zeroqueue pulse: error: give --qps, or --load with --capacity-json")
    return args.qps


def _check_doors(args: argparse.Namespace, doors: tuple[str, ...]) -> None:
    """What the doors cannot carry is refused before any replica starts."""
    if len(doors) > 1 and (args.tenant or args.capacity):
        raise SystemExit("zeroqueue pulse: error: --doors with several doors is for a run or a compare")
    if "http" in doors:
        refused = [t.name for t in templates_of(args) if t.messages or t.response_format is not None or t.logprobs]
        if refused:
            raise SystemExit(
                "zeroqueue pulse: error: the HTTP door's /v1/completions takes a prompt: no conversation, "
                f"response_format or logprobs ({', '.join(refused)})"
            )


def run_pulse(args: argparse.Namespace) -> int:
    from rich.console import Console

    console, log = Console(), Console(stderr=True)  # the tables; progress and what happens
    if not console.is_terminal:
        console = Console(width=120)  # a table that stays readable in a log file
    doors = doors_of(args)
    _check_doors(args, doors)
    out_dir = Path(args.out or f"pulse-results/{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # replicas' ledgers and keys go in it: ours alone
    shape_args = dict(
        kind=args.shape, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, sigma=args.shape_sigma
    )
    run_id = uuid.uuid4().hex[:8]
    if args.tenant:
        from .multi import run_multi_tenant

        return run_multi_tenant(args, shape_args, out_dir, run_id, console)
    if args.alone:
        raise SystemExit("zeroqueue pulse: error: --alone names a --tenant")
    if args.capacity:
        from .capacity import run_capacity

        if templates_of(args):
            raise SystemExit("zeroqueue pulse: error: --capacity measures plain calls: no --templates/--request-file")
        return run_capacity(args, shape_args, out_dir, run_id, console)
    return _run_schedule(args, doors, shape_args, out_dir, run_id, console, log)


def _title(args: argparse.Namespace, load, doors: tuple[str, ...]) -> str:
    return (
        f"pulse: {load.arrival} {load.qps:.2f} qps for {load.duration_s:.0f} s"
        + (f", bursts {load.pulse_factor}× for {load.pulse_s} s every {load.pulse_every_s} s" if load.pulse_s else "")
        + f", shape {args.shape} {args.prompt_tokens}+{args.max_tokens}, "
        f"deadline {args.deadline_ms:.0f} ms"
        + describe_mix(templates_of(args))
        + ("" if doors == ("grpc",) else f", through {' then '.join(doors)}")
    )


def _run_schedule(args, doors, shape_args: dict, out_dir: Path, run_id: str, console, log) -> int:
    """A run or a compare: the seeded schedule against each target, through each door in turn."""
    from .report import plot, print_door_table, print_table, write_json, write_traces
    from .schedule import LoadSpec
    from .targets import opened, pulse_one, targets_from

    load = LoadSpec(
        _load_qps(args), args.duration, args.arrival, args.pulse_factor, args.pulse_seconds, args.pulse_every, args.seed
    )
    runs = []
    for target in targets_from(args):
        with opened(target, args, out_dir, log) as live:
            for i, door in enumerate(doors):
                if i:
                    time.sleep(SETTLE_S)
                runs.append(pulse_one(live.through(door), args, load, shape_args, run_id, log))
    print_table(runs, _title(args, load, doors), console)
    if len(doors) > 1:
        print_door_table(runs, "doors: the same schedule through each, a row per door and mode", console)
    config = {
        "load": asdict(load),
        "shape": shape_args,
        "deadline_ms": args.deadline_ms,
        "deadline_per_token_ms": args.deadline_per_token_ms,
        "templates": [t.describe() for t in templates_of(args)],
        "doors": list(doors),
        "run_id": run_id,
    }
    write_json(out_dir / "pulse.json", runs, config)
    write_traces(out_dir, runs)
    written = [] if args.no_plots else plot(out_dir, runs)
    log.print(f"wrote {out_dir / 'pulse.json'}, traces" + "".join(f", {p.name}" for p in written) + f" in {out_dir}")
    return 0
