"""The rejection board at every load (issue 35): the articles' board (refused share, retries per refused call,
first-retry success, P99/P50 of admitted latency at the client and the replica, goodput against a FIFO queue,
admitted calls in deadline by the replica's log) for each arrival shape (Poisson, bursts, stages) at multiples of
the closed-loop capacity, a deadline replica (the default serve flags) beside a FIFO one on the same seeded
schedule, one replica at a time.

    python bench/board.py --loads 0.7,1,2,4 --arrivals poisson,burst,stages --duration 20 \\
        --out bench/results/board-2026-12-05/bundled
    python bench/board.py --model smollm2 --out bench/results/board-2026-12-05/smollm2-135m

Every cell is one `zeroqueue pulse` command (bench/slack.py's), printed to stderr before it runs; the SDK's own
retries are on. The capacity is the closed-loop saturation of a deadline replica (as bench/slack.py measures it),
measured first unless given. Bursts are a period's worth of calls at once every --pulse-every s; stages ramp up
over the first quarter, hold, and ramp down over the last (25/32 of the nominal load on average).
`--model smollm2` is bench/decode.py's random checkpoint of the SmolLM2-135M shape (made once under bench/out/).
stdout is the Markdown table; --out keeps each cell's pulse outputs and results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "bench")]

from slack import _fmt, pulse, shape  # noqa: E402  (bench/slack.py: the pulse command, the call shape)
from soak_checks import host_info  # noqa: E402  (bench/soak_checks.py)

MODES = {"deadline": "deadline", "fifo": "fifo"}  # row name: --admission (default serve flags otherwise)
ARRIVALS = ("poisson", "burst", "stages")


def model_args(ns: argparse.Namespace) -> list[str]:
    return [] if ns.model_dir is None else ["--model", str(ns.model_dir)]


def resolve_model(name: str) -> Path | None:
    """None for the bundled model; bench/decode.py's random SmolLM2-135M-shaped checkpoint for smollm2 (made
    once, torch and transformers loaded only then); else a checkpoint directory."""
    if name == "bundled":
        return None
    if name == "smollm2":
        from decode import make_model  # noqa: PLC0415  (bench/decode.py)

        return make_model()
    return Path(name)


def capacity(ns: argparse.Namespace) -> float:
    """bench/slack.py's capacity (closed-loop saturation of a deadline replica, calls a second), on --model."""
    out = ns.out / "capacity"
    if ns.reuse and (out / "capacity.json").exists():
        return json.loads((out / "capacity.json").read_text())["saturation_qps"]
    args = ["--capacity", "--admission", "deadline", f"--serve-args={ns.serve_args}", *shape(ns), *model_args(ns)]
    args += ["--duration", "10", "--knee-probes", "1", "--probe-duration", "5", "--confirm-duration", "0"]
    pulse([*args, "--out", str(out), "--no-plots", "--no-progress"])
    return json.loads((out / "capacity.json").read_text())["saturation_qps"]


def log_events(path: Path):
    """The JSON events of a replica log; two events written at once can share a line, so each line is read as a
    run of objects (the plain-text lines the replica also writes are skipped)."""
    decoder = json.JSONDecoder()
    for line in path.read_text().splitlines() if path.exists() else []:
        at = 0
        while line.startswith("{", at):
            event, at = decoder.raw_decode(line, at)
            yield event


def replica_log(path: Path) -> dict:
    """The replica's own account of the pulse's admitted calls: its `request_done` lines (one per admitted call,
    whatever became of it), how many ended ok with their deadline met."""
    done = met = 0
    outcomes: dict[str, int] = {}
    for event in log_events(path):
        if event.get("event") != "request_done" or not str(event.get("request_id", "")).startswith("pulse-"):
            continue
        done += 1
        outcomes[event["outcome"]] = outcomes.get(event["outcome"], 0) + 1
        met += event["outcome"] == "ok" and bool(event.get("deadline_met"))
    return {"admitted": done, "in_deadline": met, "share": met / done if done else None, "outcomes": outcomes}


def cell(ns: argparse.Namespace, mode: str, arrival: str, qps: float, out: Path) -> dict:
    args = ["--admission", MODES[mode], f"--serve-args={ns.serve_args}", "--qps", f"{qps:.3f}", *shape(ns)]
    args += ["--arrival", arrival, *(["--pulse-every", f"{ns.pulse_every:g}"] if arrival == "burst" else [])]
    args += [*model_args(ns), "--duration", f"{ns.duration:g}", "--seed", str(ns.seed), "--out", str(out)]
    if not (ns.reuse and (out / "pulse.json").exists()):
        pulse([*args, "--no-plots", "--no-progress"])
    (run,) = json.loads((out / "pulse.json").read_text())["runs"].values()  # keyed by the mode it started
    s, log = run["summary"], replica_log(out / f"replica-{MODES[mode]}" / "replica.log")
    return {
        "offered_qps": qps,
        "sent": s["num_sent"],
        "goodput_rps": s["goodput_rps"],
        "refused_share": s["rejection_rate"],
        "retries_per_refused": s["avg_retries_per_rejected"],
        "first_retry_success": s["first_retry_success_rate"],
        "p99_over_p50_client": s["p99_over_p50"],
        "p99_over_p50_replica": s["server_p99_over_p50"],
        "admitted_p50_ms": s["admitted_latency_ms"]["p50"],
        "admitted_in_deadline_client": None if s["admitted_miss_rate"] is None else 1.0 - s["admitted_miss_rate"],
        "admitted_misses_client": s["num_admitted_misses"],
        "admitted_in_deadline_replica": log["share"],
        "replica_log": log,
        "replica_deadline_misses": (run.get("server") or {}).get("deadline_misses"),
        "scheduler_lag_max_ms": s["max_dispatch_lag_ms"],
    }


def _pct(value, spec: str = ".1%") -> str:
    return _fmt(value, spec).replace("%", " %")


def table(rows: list[dict]) -> str:
    lines = [
        "| shape | load | mode | goodput, req/s | vs fifo | refused | retries / refused | first retry ok "
        "| P99/P50 client (replica) | admitted in deadline, replica log (client) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    fifo = {(r["arrival"], r["load"]): r["goodput_rps"] for r in rows if r["mode"] == "fifo"}
    for r in rows:
        base = fifo.get((r["arrival"], r["load"]))
        vs = None if r["mode"] == "fifo" or not base else r["goodput_rps"] / base
        vs_text = "–" if r["mode"] == "fifo" else ("∞ (fifo 0)" if base == 0 else _fmt(vs, ".2f") + "×")
        lines.append(
            f"| {r['arrival']} | {r['load']:g}× | {r['mode']} | {r['goodput_rps']:.2f} | {vs_text} "
            f"| {_pct(r['refused_share'])} | {_fmt(r['retries_per_refused'], '.2f')} "
            f"| {_pct(r['first_retry_success'])} | {_fmt(r['p99_over_p50_client'], '.2f')} "
            f"({_fmt(r['p99_over_p50_replica'], '.2f')}) | {_pct(r['admitted_in_deadline_replica'], '.2%')} "
            f"({_pct(r['admitted_in_deadline_client'], '.2%')}) |"
        )
    return "\n".join(lines)


def host() -> dict:
    """soak_checks.host_info, with the CPU's family and model numbers (as lscpu shows them)."""
    info = host_info()
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    for key in ("cpu family", "model"):
        info[key.replace(" ", "_")] = next(
            (line.split(":", 1)[1].strip() for line in cpuinfo if line.split(":")[0].strip() == key), "?"
        )
    info["avx512_flags"] = sorted(
        {f for line in cpuinfo if line.startswith("flags") for f in line.split() if f.startswith("avx512")}
    )
    return info


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled", help="bundled (default), smollm2, or a checkpoint directory")
    parser.add_argument("--capacity-qps", type=float, default=None, help="default: measured first (closed loop)")
    parser.add_argument("--loads", default="0.7,1,2,4", help="multiples of the capacity, comma-separated")
    parser.add_argument("--arrivals", default=",".join(ARRIVALS), help="pulse --arrival shapes, comma-separated")
    parser.add_argument("--skip", default="", help="cells not to run, e.g. burst@0.7,stages@0.7")
    parser.add_argument("--pulse-every", type=float, default=1.0, help="burst: a period's worth at once every so often")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's seed, the same for both modes")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--deadline-ms", type=float, default=2000.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--serve-args", default="", help="extra `zeroqueue serve` arguments for both modes")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/board")
    parser.add_argument("--reuse", action="store_true", help="read the cells --out already has instead of rerunning")
    parser.add_argument("--table-only", action="store_true", help="only print the table of --out's results.json")
    ns = parser.parse_args()
    if ns.table_only:
        print(table(json.loads((ns.out / "results.json").read_text())["rows"]))
        return 0
    ns.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    info, head = host(), git("rev-parse", "HEAD")  # others may commit in this tree while it runs
    ns.model_dir = resolve_model(ns.model)
    qps = ns.capacity_qps or capacity(ns)
    print(f"capacity {qps:.2f} req/s", file=sys.stderr, flush=True)
    skip = {tuple(x.split("@")) for x in ns.skip.split(",") if x}
    rows = []
    for arrival in ns.arrivals.split(","):
        for load in (float(x) for x in ns.loads.split(",")):
            if (arrival, f"{load:g}") in skip:
                continue
            for mode in MODES:
                out = ns.out / f"{arrival}-{load:g}x-{mode}"
                rows.append(
                    {"arrival": arrival, "load": load, "mode": mode, **cell(ns, mode, arrival, load * qps, out)}
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {
        "host": info,
        "loadavg_end": os.getloadavg(),
        "git_head_start": head,
        "git_head": git("rev-parse", "HEAD"),
        "git_status": git("status", "--porcelain").splitlines(),
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "wall_s": round(time.time() - started, 1),
        "args": {k: str(v) for k, v in vars(ns).items()},
        "capacity_qps": qps,
        "rows": rows,
    }
    (ns.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    from services.logs import configure_logging

    configure_logging()  # every line on stderr: stdout is the bench's report
    sys.exit(main())
