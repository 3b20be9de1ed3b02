"""Class priority on a real replica (issue 22): does an interactive class keep its goodput while the same tenant's
batch class floods the replica?

One tenant, two keys: one sends batch-class calls at 4x capacity, the other interactive-class calls at 0.4x. Being
one tenant, fair share cannot help the interactive calls: only class priority can. Two replicas of the bundled
model, each with the classes `batch` (priority 0) and `interactive` (priority 50) in its ledger: first-come
(`--no-fair-share`: no priority either) and the default. Against each in turn, the same seeded traffic with
`zeroqueue pulse --tenant` (bench/fair_share.py's runs): the interactive schedule alone, then both together.

    python bench/class_priority.py --capacity-qps 16.8 --duration 15 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "bench")]

from fair_share import measure_capacity, shape  # noqa: E402  (bench/fair_share.py)
from soak_checks import host_info  # noqa: E402

from services.inference.bundled_model import default_model  # noqa: E402
from services.logs import configure_logging  # noqa: E402
from services.pulse.replicas import start_replica  # noqa: E402

PULSE = [sys.executable, "-m", "services.cli", "pulse"]
MODES = {"first-come": ["--no-fair-share"], "priority": []}
CLASSES = {"batch": 0, "interactive": 50}  # class: priority
STREAMS = {"batch": "A", "interactive": "B"}  # pulse's name of each class's stream: A floods, B is modest


def provision(replica) -> dict[str, str]:
    """The classes, and one tenant with a key per class's stream, in the replica's ledger."""
    from billing.commands import sessions
    from billing.db import unit_of_work
    from billing.service_classes import add_class
    from billing.tenants import create_tenant, create_tenant_key

    with sessions(replica.ledger_url) as factory, unit_of_work(factory) as session:
        for name, priority in CLASSES.items():
            add_class(session, name, min_budget_ms=100, max_budget_ms=60_000, priority=priority, credit_ppm=10**6)
        keys = {"batch": create_tenant(session, "acme").key}
        keys["interactive"] = create_tenant_key(session, "acme").key
    return keys


def one_run(replica, keys: dict[str, str], args: argparse.Namespace, seed: int, out: Path) -> dict:
    loads = {"batch": args.a_load, "interactive": args.b_load}
    cmd = [*PULSE, "--endpoint", replica.address, "--metrics-url", replica.metrics_url, *shape(args)]
    for cls, stream in STREAMS.items():
        cmd += ["--tenant", f"name={stream},key={keys[cls]},class={cls},qps={loads[cls] * args.capacity_qps:.3f}"]
    cmd += ["--alone", "B", "--duration", str(args.duration), "--seed", str(seed), "--out", str(out)]
    subprocess.run([*cmd, "--no-plots", "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    run = json.loads((out / "pulse.json").read_text())["runs"]["run"]
    a, b = run["tenants"]["A"], run["tenants"]["B"]
    return {
        "interactive_goodput_vs_alone": b["goodput_vs_alone"],
        "interactive_goodput_rps": b["goodput_rps"],
        "interactive_alone_goodput_rps": b["alone"]["goodput_rps"],
        "interactive_admitted_share": b["admitted_share"],
        "interactive_in_deadline_of_admitted": b["in_deadline_of_admitted"],
        "batch_goodput_rps": a["goodput_rps"],
        "batch_in_deadline_of_admitted": a["in_deadline_of_admitted"],
        "total_goodput_rps": run["total"]["goodput_rps"],
        "replica_refusals_by_kind": b["replica_refusals_by_kind"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the bundled model")
    parser.add_argument("--capacity-qps", type=float, default=None, help="default: measured first (short knee)")
    parser.add_argument("--a-load", type=float, default=4.0, help="the batch class's rate, a multiple of capacity")
    parser.add_argument("--b-load", type=float, default=0.4, help="the interactive class's rate, likewise")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--deadline-ms", type=float, default=4000.0)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve-args", default="--pace-tokens 64")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/class-priority")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, replicas = args.model or default_model(), {}
    result = {"host": host_info(), "args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    try:
        for mode, extra in MODES.items():
            replica = start_replica(model, "deadline", args.out, [*shlex.split(args.serve_args), *extra], name=mode)
            replicas[mode] = (replica, provision(replica))
        if args.capacity_qps is None:
            args.capacity_qps = measure_capacity(replicas["priority"][0], args)
        result["capacity_qps"] = args.capacity_qps
        names = list(MODES)
        for rep in range(args.repeats):
            for mode in names[rep % len(names) :] + names[: rep % len(names)]:
                replica, keys = replicas[mode]
                row = one_run(replica, keys, args, rep, args.out / f"rep{rep}-{mode}")
                result["runs"].setdefault(mode, []).append(row)
                print(f"rep {rep} {mode}: {json.dumps(row)}", flush=True)
    finally:
        for replica, _ in replicas.values():
            replica.stop()
    result["host"]["loadavg_end"] = os.getloadavg()
    result["median"] = {
        mode: {k: statistics.median(r[k] for r in rows) for k, v in rows[0].items() if isinstance(v, int | float)}
        for mode, rows in result["runs"].items()
    }
    print(json.dumps(result["median"], indent=2))
    (args.out / "class_priority.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    sys.exit(main())
