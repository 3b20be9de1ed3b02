"""Fair share under a flood (issue 22): does a modest tenant keep its goodput while another floods the replica?

Three replicas of the bundled model, started as `zeroqueue pulse` starts them and each given tenants A and B:
FIFO (`--admission fifo`), first-come deadline admission (`--no-fair-share`: the admission before fair share) and
fair share (the default). Against each in turn, the same seeded traffic with `zeroqueue pulse --tenant`: B's
schedule alone first, then A (flooding, 4x capacity) and B (modest, 0.4x) together. Reported per run: B's goodput
beside A against its goodput alone, B's admitted and in-deadline shares, A's goodput, the total, and the replica's
refusals of each by kind. The capacity is measured first on the fair-share replica (`pulse --capacity`, short), or
given.

    python bench/fair_share.py --duration 15 --repeats 3 --serve-args "--pace-tokens 64"

Every repeat runs each mode once (the modes' order rotating) with its own seed, so the modes see the same
schedules; medians over the repeats are reported, the goal being B's goodput beside A >= 95 % of its goodput alone.
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

from soak_checks import host_info  # noqa: E402  (bench/soak_checks.py)

from services.inference.bundled_model import default_model  # noqa: E402
from services.logs import configure_logging  # noqa: E402
from services.pulse.replicas import start_replica  # noqa: E402

PULSE = [sys.executable, "-m", "services.cli", "pulse"]
TENANTS = {"A": "flood", "B": "modest"}  # the ledger's names (lower case): A floods at 4x, B sends 0.4x
MODES = {  # name: (--admission, extra serve arguments)
    "fifo": ("fifo", []),
    "first-come": ("deadline", ["--no-fair-share"]),
    "fair share": ("deadline", []),
}


def serve_has(flag: str) -> bool:
    help_text = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    return flag in help_text


def shape(args: argparse.Namespace) -> list[str]:
    return ["--shape", "fixed", "--prompt-tokens", "64", "--max-tokens", str(args.max_tokens), "--deadline-ms"] + [
        str(args.deadline_ms)
    ]


def measure_capacity(replica, args: argparse.Namespace) -> float:
    """A short `pulse --capacity` against the replica: the knee, without the long confirmation runs."""
    out = args.out / "capacity"
    cmd = [*PULSE, "--capacity", "--endpoint", replica.address, "--api-key", replica.api_key, *shape(args)]
    cmd += ["--metrics-url", replica.metrics_url, "--duration", "10", "--knee-probes", "4", "--probe-duration"]
    cmd += ["10", "--confirm-duration", "0", "--out", str(out), "--no-progress", "--no-plots"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "capacity.json").read_text())["capacity_qps"]


def one_run(replica, keys: dict[str, str], args: argparse.Namespace, seed: int, out: Path) -> dict:
    """B alone, then A and B together, against one replica: pulse's figures for each tenant."""
    a, b = TENANTS["A"], TENANTS["B"]
    tenants = [
        f"name={a},key={keys['A']},qps={args.a_load * args.capacity_qps:.3f}",
        f"name={b},key={keys['B']},qps={args.b_load * args.capacity_qps:.3f}",
    ]
    cmd = [*PULSE, "--endpoint", replica.address, "--metrics-url", replica.metrics_url, *shape(args)]
    cmd += [arg for spec in tenants for arg in ("--tenant", spec)]
    cmd += ["--alone", b, "--duration", str(args.duration), "--seed", str(seed), "--out", str(out)]
    subprocess.run([*cmd, "--no-plots", "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "pulse.json").read_text())["runs"]["run"]


def row(run: dict) -> dict:
    a, b = run["tenants"][TENANTS["A"]], run["tenants"][TENANTS["B"]]
    return {
        "b_goodput_rps": b["goodput_rps"],
        "b_alone_goodput_rps": b["alone"]["goodput_rps"],
        "b_goodput_vs_alone": b["goodput_vs_alone"],
        "b_admitted_share": b["admitted_share"],
        "b_in_deadline_of_admitted": b["in_deadline_of_admitted"],
        "b_alone_admitted_share": b["alone"]["admitted_share"],
        "a_goodput_rps": a["goodput_rps"],
        "a_admitted_share": a["admitted_share"],
        "a_in_deadline_of_admitted": a["in_deadline_of_admitted"],
        "total_goodput_rps": run["total"]["goodput_rps"],
        "b_refusals_by_kind": b["replica_refusals_by_kind"],
        "a_refusals_by_kind": a["replica_refusals_by_kind"],
        "b_refusals": b["replica_refusals"],
        "max_dispatch_lag_ms": max(f["summary"]["max_dispatch_lag_ms"] or 0 for f in (a, b, b["alone"])),
        "notes": run["notes"],
    }


def medians(rows: list[dict]) -> dict:
    keys = [k for k, v in rows[0].items() if isinstance(v, float | int)]
    return {k: statistics.median(r[k] for r in rows if r[k] is not None) for k in keys}


def table(result: dict) -> str:
    """The Markdown table of the medians, one line per mode."""
    lines = [
        "| mode | B goodput vs alone | B goodput (alone), req/s | B admitted | B in deadline of admitted | "
        "A goodput, req/s | total goodput, req/s | B refused by the replica (kinds, last run) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode, m in result["median"].items():
        kinds = result["runs"][mode][-1]["b_refusals_by_kind"] or {}
        lines.append(
            f"| {mode} | {m['b_goodput_vs_alone']:.3f} | {m['b_goodput_rps']:.2f} ({m['b_alone_goodput_rps']:.2f}) | "
            f"{m['b_admitted_share']:.1%} | {m['b_in_deadline_of_admitted']:.1%} | {m['a_goodput_rps']:.2f} | "
            f"{m['total_goodput_rps']:.2f} | {', '.join(f'{k} {v}' for k, v in kinds.items()) or 'none'} |"
        )
    return "\n".join(lines)


def start_all(args: argparse.Namespace, modes: dict) -> dict:
    """One replica per mode, started one after another (calibration alone on the cores), each with tenants A, B."""
    model, replicas = args.model or default_model(), {}
    try:
        for mode, (admission, extra) in modes.items():
            slug = mode.replace(" ", "-")
            replica = start_replica(model, admission, args.out, [*shlex.split(args.serve_args), *extra], name=slug)
            replicas[mode] = (replica, keys := {})
            keys.update({tenant: replica.create_tenant(name) for tenant, name in TENANTS.items()})
            print(f"{mode}: SERVING on {replica.address} ({admission} {' '.join(extra)})", flush=True)
    except BaseException:
        for replica, _ in replicas.values():
            replica.stop()
        raise
    return replicas


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the bundled model")
    parser.add_argument("--capacity-qps", type=float, default=None, help="default: measured first (short knee)")
    parser.add_argument("--a-load", type=float, default=4.0, help="A's rate, a multiple of the capacity")
    parser.add_argument("--b-load", type=float, default=0.4, help="B's rate, a multiple of the capacity")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="output tokens a call (64 in its prompt): long calls keep 4x a rate the load generator sends lightly",
    )
    parser.add_argument("--deadline-ms", type=float, default=4000.0)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per run (alone and together)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the modes, interleaved")
    parser.add_argument("--serve-args", default="--pace-tokens 64", help="extra `zeroqueue serve` arguments")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/fair-share")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    modes = dict(MODES)
    notes = []
    if not serve_has("--no-fair-share"):
        del modes["first-come"]
        notes.append("zeroqueue serve has no --no-fair-share here: no first-come run")
    result = {"host": host_info(), "args": {k: str(v) for k, v in vars(args).items()}, "notes": notes, "runs": {}}
    replicas = start_all(args, modes)
    try:
        if args.capacity_qps is None:
            args.capacity_qps = measure_capacity(replicas["fair share"][0], args)
        result["capacity_qps"] = args.capacity_qps
        print(f"capacity {args.capacity_qps:.2f} req/s: A {args.a_load:g}x, B {args.b_load:g}x", flush=True)
        names = list(modes)
        for rep in range(args.repeats):
            for mode in names[rep % len(names) :] + names[: rep % len(names)]:
                replica, keys = replicas[mode]
                run = one_run(replica, keys, args, rep, args.out / f"rep{rep}-{mode.replace(' ', '-')}")
                result["runs"].setdefault(mode, []).append(row(run))
                print(f"rep {rep} {mode}: {json.dumps(result['runs'][mode][-1])}", flush=True)
    finally:
        for replica, _ in replicas.values():
            replica.stop()
    result["host"]["loadavg_end"] = os.getloadavg()
    result["median"] = {mode: medians(rows) for mode, rows in result["runs"].items()}
    print(table(result))
    (args.out / "fair_share.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    sys.exit(main())
