"""A device that slows down mid-traffic: deadline admission beside a FIFO queue, before, during and after.

Each mode gets its own replica (the bundled model, started as `zeroqueue pulse` starts them) with a fault injected
(`--inject-fault slow:FACTOR,after=A,for=B`: every device operation FACTOR times as long, from A s after warm-up for
B s), and the same open-loop schedule from `zeroqueue pulse --endpoint … --qps R`. The fault's window comes from
the replica's own log (`fault_injected`, then A and B), and is placed on the client's clock through the calls both
sides name (pulse's request ids end in the call's index; the replica logs `request_done` with its finish time).

Reported per window of arrivals (before the fault; its first second; the rest of it; the second after it; after):
offered calls, refused (overloaded or infeasible; FIFO refuses nothing), admitted (every other call: a FIFO call that
ran out of time in its queue counts as admitted and missed), admitted calls in deadline, and goodput (calls per
second finished in deadline).
Also when the watchdog called the device slow and healthy again, from the fault's start and end.

    python bench/slowdown.py --qps 80 --factor 2 --after-s 20 --for-s 20 --duration 60 --out bench/results/slowdown
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "bench")]

from soak_checks import host_info  # noqa: E402  (bench/soak_checks.py)

from services.inference.bundled_model import default_model  # noqa: E402
from services.logs import configure_logging  # noqa: E402
from services.pulse.replicas import start_replica  # noqa: E402

WINDOWS = ("before", "fault, 1st s", "fault, rest", "after, 1st s", "after")


def epoch_s(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def replica_events(log_path: Path) -> dict:
    """The fault's arming, the watchdog's verdicts and every call's end, from the replica's JSON log."""
    armed, verdicts, done = None, [], {}
    for line in log_path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        name, at = event.get("event"), epoch_s(event["timestamp"]) if "timestamp" in event else None
        if name == "fault_injected" and armed is None:
            armed = at
        elif name == "device_state":
            verdicts.append((at, event["state"], event.get("ratio")))
        elif name == "request_done":
            done[int(event["request_id"].rsplit("-", 1)[1])] = at
    return {"armed": armed, "verdicts": verdicts, "done": done}


def offset_s(traces: list[dict], done: dict[int, float]) -> float:
    """Epoch seconds of the client's t = 0: the median over calls of the replica's end less the client's."""
    gaps = [done[t["index"]] - t["finished_s"] for t in traces if t["index"] in done and t["finished_s"] is not None]
    return statistics.median(gaps)


def window_of(at_s: float, start_s: float, end_s: float) -> str:
    if at_s < start_s:
        return WINDOWS[0]
    if at_s < start_s + 1:
        return WINDOWS[1]
    if at_s < end_s:
        return WINDOWS[2]
    return WINDOWS[3] if at_s < end_s + 1 else WINDOWS[4]


def tally(traces: list[dict], start_s: float, end_s: float, duration_s: float) -> dict:
    spans = {
        WINDOWS[0]: start_s,
        WINDOWS[1]: 1.0,
        WINDOWS[2]: end_s - start_s - 1,
        WINDOWS[3]: 1.0,
        WINDOWS[4]: duration_s - end_s - 1,
    }
    rows = {w: {"offered": 0, "refused": 0, "admitted": 0, "in_deadline": 0} for w in WINDOWS}
    for t in traces:
        row = rows[window_of(t["planned_s"], start_s, end_s)]
        row["offered"] += 1
        refused = t["outcome"] in ("rejected", "infeasible", "not_sent")  # FIFO's misses end as deadline_exceeded
        row["admitted"] += not refused
        row["refused"] += refused
        row["in_deadline"] += t["outcome"] == "ok" and bool(t["server_deadline_met"])
    for window, row in rows.items():
        row["attainment_pct"] = round(100 * row["in_deadline"] / row["admitted"], 2) if row["admitted"] else None
        row["goodput_rps"] = round(row["in_deadline"] / spans[window], 2) if spans[window] > 0 else None
    return rows


def run_mode(mode: str, args: argparse.Namespace, out: Path) -> dict:
    fault = f"slow:{args.factor},after={args.after_s},for={args.for_s}"
    serve_args = ["--inject-fault", fault, *shlex.split(args.serve_args)]
    replica = start_replica(default_model(), mode, out, serve_args)
    try:
        pulse = [sys.executable, "-m", "services.cli", "pulse", "--endpoint", replica.address]
        pulse += ["--api-key", replica.api_key, "--metrics-url", replica.metrics_url, "--qps", str(args.qps)]
        pulse += ["--duration", str(args.duration), "--shape", "fixed", "--prompt-tokens", "64", "--max-tokens"]
        pulse += ["32", "--deadline-ms", "2000", "--seed", "0", "--out", str(out / mode), "--no-plots"]
        subprocess.run([*pulse, "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    finally:
        replica.stop()
    (trace_path,) = (out / mode).glob("trace-*.jsonl")
    traces = [json.loads(line) for line in trace_path.read_text().splitlines()]
    events = replica_events(replica.log_path)
    zero = offset_s(traces, events["done"])
    start_s = events["armed"] + args.after_s - zero
    end_s = start_s + args.for_s
    verdicts = [(round(at - zero - start_s, 3), state, ratio) for at, state, ratio in events["verdicts"]]
    return {
        "fault": fault,
        "fault_window_s": [round(start_s, 2), round(end_s, 2)],
        "verdicts_from_fault_start_s": verdicts,
        "windows": tally(traces, start_s, end_s, args.duration),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qps", type=float, default=80.0)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--after-s", type=float, default=20.0, help="the fault's start, from warm-up's end")
    parser.add_argument("--for-s", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--serve-args", default="--pace-tokens 64")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/slowdown")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"host": host_info(), "args": {k: str(v) for k, v in vars(args).items()}}
    for mode in ("deadline", "fifo"):
        result[mode] = run_mode(mode, args, args.out)
        report = result[mode]
        print(f"\n{mode}: fault over {report['fault_window_s']} s; verdicts {report['verdicts_from_fault_start_s']}")
        header = ("offered", "refused", "admitted", "in deadline", "attained", "goodput")
        print(f"{'window':<14} " + " ".join(f"{h:>11}" for h in header))
        for window, row in result[mode]["windows"].items():
            attained = "-" if row["attainment_pct"] is None else f"{row['attainment_pct']:.2f} %"
            print(
                f"{window:<14} {row['offered']:>11} {row['refused']:>11} {row['admitted']:>11} "
                f"{row['in_deadline']:>11} {attained:>11} {row['goodput_rps'] or 0:>11.1f}"
            )
    (args.out / "slowdown.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out / 'slowdown.json'} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    return 0


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    sys.exit(main())
