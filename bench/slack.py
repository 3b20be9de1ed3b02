"""Holding calls in their slack (issue 35): the same seeded Poisson schedule against a FIFO replica, deadline
admission that refuses what does not fit now with a reserved retry (`--no-hold`, the default), and deadline
admission that holds a call for a slot inside its slack (`--hold`), one replica at a time, at multiples of the
closed-loop capacity.

    python bench/slack.py --loads 1,2 --duration 20 --out bench/results/slack-2026-12-04

The capacity is the closed-loop saturation (`pulse --capacity`'s first phase: 32 callers back to back) of a
deadline replica, measured first unless given. Every cell is one `zeroqueue pulse` command, printed to stderr
before it runs; the SDK's own retries are on. stdout is the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "bench")]

from soak_checks import host_info  # noqa: E402  (bench/soak_checks.py)

MODES = {  # name: (--admission, extra serve arguments)
    "fifo": ("fifo", ""),
    "refuse": ("deadline", "--no-hold"),
    "hold": ("deadline", "--hold"),
}


def pulse(args: list[str]) -> None:
    print("+ zeroqueue pulse " + " ".join(shlex.quote(a) for a in args), file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "services.cli", "pulse", *args], check=True, stdout=subprocess.DEVNULL)


def shape(ns: argparse.Namespace) -> list[str]:
    return ["--shape", "fixed", "--prompt-tokens", str(ns.prompt_tokens), "--max-tokens", str(ns.max_tokens)] + [
        "--deadline-ms",
        str(ns.deadline_ms),
    ]


def capacity(ns: argparse.Namespace) -> float:
    """The closed-loop saturation of a deadline replica, in calls a second."""
    out = ns.out / "capacity"
    pulse(
        [
            "--capacity",
            "--admission",
            "deadline",
            f"--serve-args={ns.serve_args}",
            *shape(ns),
            "--duration",
            "10",
            "--knee-probes",
            "1",
            "--probe-duration",
            "5",
            "--confirm-duration",
            "0",
            "--out",
            str(out),
            "--no-plots",
            "--no-progress",
        ]
    )
    return json.loads((out / "capacity.json").read_text())["saturation_qps"]


def cell(ns: argparse.Namespace, mode: str, qps: float, seed: int, out: Path) -> dict:
    admission, extra = MODES[mode]
    serve_args = " ".join(a for a in (ns.serve_args, extra) if a)
    args = ["--admission", admission, f"--serve-args={serve_args}", "--qps", f"{qps:.3f}", *shape(ns)]
    args += ["--duration", str(ns.duration), "--seed", str(seed), "--out", str(out), "--no-plots", "--no-progress"]
    pulse(args)
    (run,) = json.loads((out / "pulse.json").read_text())["runs"].values()  # keyed by the mode it started
    s = run["summary"]
    return {
        "offered_qps": qps,
        "goodput_rps": s["goodput_rps"],
        "refused_share": s["rejection_rate"],
        "retries_per_refused": s["avg_retries_per_rejected"],
        "first_retry_success": s["first_retry_success_rate"],
        "admitted_in_deadline": 1.0 - (s["admitted_miss_rate"] or 0.0),
        "admitted_misses": s["num_admitted_misses"],
        "p99_over_p50_client": s["p99_over_p50"],
        "p99_over_p50_replica": s["server_p99_over_p50"],
        "admitted_p50_ms": s["admitted_latency_ms"]["p50"],
        "replica_deadline_misses": run["server"].get("deadline_misses"),
    }


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    lines = [
        "| load | seed | mode | goodput, req/s | vs fifo | refused | retries / refused | first retry ok | admitted in "
        "deadline | P99/P50 client (replica) | admitted P50, ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    fifo = {(r["load"], r["seed"]): r["goodput_rps"] for r in rows if r["mode"] == "fifo"}
    for r in rows:
        base = fifo.get((r["load"], r["seed"]))
        lines.append(
            f"| {r['load']:g}× | {r['seed']} | {r['mode']} | {r['goodput_rps']:.2f} | "
            f"{_fmt(r['goodput_rps'] / base if base else None, '.2f')} | {r['refused_share']:.1%} | "
            f"{_fmt(r['retries_per_refused'], '.2f')} | {_fmt(r['first_retry_success'], '.1%')} | "
            f"{r['admitted_in_deadline']:.1%} | {_fmt(r['p99_over_p50_client'], '.2f')} "
            f"({_fmt(r['p99_over_p50_replica'], '.2f')}) | {_fmt(r['admitted_p50_ms'], '.0f')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity-qps", type=float, default=None, help="default: measured first (closed loop)")
    parser.add_argument("--loads", default="1,2", help="multiples of the capacity, comma-separated")
    parser.add_argument("--seeds", default="1", help="one run of every mode per seed and load")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--deadline-ms", type=float, default=2000.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--serve-args", default="", help="extra `zeroqueue serve` arguments for every mode")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/slack")
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    qps = ns.capacity_qps or capacity(ns)
    print(f"capacity {qps:.2f} req/s", file=sys.stderr, flush=True)
    rows = []
    for load in (float(x) for x in ns.loads.split(",")):
        for seed in (int(x) for x in ns.seeds.split(",")):
            for mode in MODES:
                slug = f"{load:g}x-seed{seed}-{mode.split()[0]}"
                rows.append(
                    {"load": load, "seed": seed, "mode": mode, **cell(ns, mode, load * qps, seed, ns.out / slug)}
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {"host": host_info(), "args": {k: str(v) for k, v in vars(ns).items()}, "capacity_qps": qps, "rows": rows}
    (ns.out / "slack.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    from services.logs import configure_logging

    configure_logging()  # every line on stderr: stdout is the bench's report
    sys.exit(main())
