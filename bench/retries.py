"""Do retries the server invites help? Goodput of one deadline replica with and without the SDK's hint-honouring
retries, on the same open-loop schedule, at several rates.

One replica (started as `zeroqueue pulse` starts them) serves every run in turn, so the runs differ only in the
callers: `zeroqueue pulse --endpoint … --qps R --max-attempts N` for each rate and each N (1: no retries; 2: one
retry, as a careful client makes; 8: the SDK's default). Reported per run: goodput (calls finished in deadline per
second), the first attempts refused, first-retry success, retries per refused call, and admitted calls that missed.

    python bench/retries.py --model bench/out/smollm2-135m-random --qps 7,14,28 --attempts 1,2,8 --duration 40
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "bench")]

from soak_checks import host_info  # noqa: E402  (bench/soak_checks.py)

from services.pulse.replicas import default_model, start_replica  # noqa: E402

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the bundled model")
    parser.add_argument("--qps", type=numbers, default=[7.0, 14.0, 28.0], help="rates, comma-separated")
    parser.add_argument("--attempts", type=lambda t: numbers(t, int), default=[1, 2, 8], help="max attempts")
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--serve-args", default="", help="extra `zeroqueue serve` arguments")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/retries")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    replica = start_replica(args.model or default_model(), "deadline", args.out, shlex.split(args.serve_args))
    result = {"host": host_info(), "args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    try:
        for qps in args.qps:
            for attempts in args.attempts:
                run = args.out / f"qps{qps:g}-attempts{attempts}"
                cmd = [sys.executable, "-m", "services.cli", "pulse", "--endpoint", replica.address, "--api-key"]
                cmd += [replica.api_key, "--metrics-url", replica.metrics_url, "--qps", str(qps), "--duration"]
                cmd += [str(args.duration), "--shape", "fixed", "--prompt-tokens", "64", "--max-tokens", "32"]
                cmd += ["--deadline-ms", "2000", "--seed", "1", "--max-attempts", str(attempts), "--out", str(run)]
                subprocess.run([*cmd, "--no-plots", "--no-progress"], check=True, stdout=subprocess.DEVNULL)
                summary = json.loads((run / "pulse.json").read_text())["runs"]["run"]["summary"]
                result["runs"][f"{qps:g} req/s, {attempts} attempts"] = row = {k: summary[k] for k in KEYS}
                print(f"{qps:>6g} req/s, at most {attempts} attempts: {json.dumps(row)}", flush=True)
                time.sleep(3)  # the last calls' retries drain before the next run
    finally:
        replica.stop()
    (args.out / "retries.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
