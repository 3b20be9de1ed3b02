"""Do retries the server invites help? Goodput of one deadline replica with and without the SDK's hint-honouring
retries, on the same open-loop schedule, at several rates.

One replica (started as `zeroqueue pulse` starts them) serves every run in turn, so the runs differ only in the
callers: `zeroqueue pulse --endpoint … --qps R --max-attempts N` for each rate and each N (1: no retries; 2: one
retry, as a careful client makes; 8: the SDK's default). Reported per run: goodput (calls finished in deadline per
second), the first attempts refused, first-retry success, retries per refused call, and admitted calls that missed.

    python bench/retries.py --model bench/out/smollm2-135m-random --qps 7,14,28 --attempts 1,2,8 --duration 40

With --repeats R every rate and setting runs R times, interleaved (the settings' order rotating), and the median
goodput per cell is reported: one run to the next on a 2-core host differs by a few per cent.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "bench")]

from soak_checks import host_info  # noqa: E402  (bench/soak_checks.py)

from services.inference.bundled_model import default_model  # noqa: E402
from services.logs import configure_logging  # noqa: E402
from services.pulse.replicas import start_replica  # noqa: E402

KEYS = (
    "goodput_rps",
    "rejection_rate",
    "first_retry_success_rate",
    "avg_retries_per_rejected",
    "num_admitted",
    "num_in_deadline",
    "num_admitted_misses",
)


def numbers(text: str, kind=float) -> list:
    return [kind(part) for part in text.split(",")]


def reservation_events(metrics_url: str) -> dict[str, float]:
    """The replica's zeroqueue_reservation_events_total, by event."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    prefix = 'zeroqueue_reservation_events_total{event="'
    return {
        line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def one_run(replica, args: argparse.Namespace, qps: float, attempts: int, run: Path) -> dict:
    """One pulse against the replica: its summary and what became of the replica's reservations meanwhile."""
    cmd = [sys.executable, "-m", "services.cli", "pulse", "--endpoint", replica.address, "--api-key"]
    cmd += [replica.api_key, "--metrics-url", replica.metrics_url, "--qps", str(qps), "--duration"]
    cmd += [str(args.duration), "--shape", "fixed", "--prompt-tokens", "64", "--max-tokens", "32"]
    cmd += ["--deadline-ms", "2000", "--seed", "1", "--max-attempts", str(attempts), "--out", str(run)]
    before = reservation_events(replica.metrics_url)
    subprocess.run([*cmd, "--no-plots", "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    time.sleep(3)  # the last calls' retries drain (and their reservations lapse) before the next run
    after = reservation_events(replica.metrics_url)
    summary = json.loads((run / "pulse.json").read_text())["runs"]["run"]["summary"]
    row = {k: summary[k] for k in KEYS}
    row["reservation_events"] = {k: int(v - before.get(k, 0)) for k, v in after.items() if v > before.get(k, 0)}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the bundled model")
    parser.add_argument("--qps", type=numbers, default=[7.0, 14.0, 28.0], help="rates, comma-separated")
    parser.add_argument("--attempts", type=lambda t: numbers(t, int), default=[1, 2, 8], help="max attempts")
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--repeats", type=int, default=1, help="rounds over every rate and attempts, interleaved")
    parser.add_argument("--serve-args", default="", help="extra `zeroqueue serve` arguments")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/retries")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    replica = start_replica(args.model or default_model(), "deadline", args.out, shlex.split(args.serve_args))
    result = {"host": host_info(), "args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    try:
        for rep in range(args.repeats):
            for qps in args.qps:
                # the attempts rotate from one repeat to the next: no setting always runs first, or last
                for attempts in args.attempts[rep % len(args.attempts) :] + args.attempts[: rep % len(args.attempts)]:
                    row = one_run(replica, args, qps, attempts, args.out / f"rep{rep}-qps{qps:g}-attempts{attempts}")
                    result["runs"].setdefault(f"{qps:g} req/s, {attempts} attempts", []).append(row)
                    print(f"rep {rep}: {qps:>6g} req/s, at most {attempts} attempts: {json.dumps(row)}", flush=True)
    finally:
        replica.stop()
    result["median_goodput_rps"] = {
        cell: statistics.median(row["goodput_rps"] for row in rows) for cell, rows in result["runs"].items()
    }
    for cell, goodput in result["median_goodput_rps"].items():
        print(f"{cell}: median goodput {goodput:.2f} req/s")
    (args.out / "retries.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    sys.exit(main())
