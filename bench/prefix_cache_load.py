"""Admission with the prefix cache under load: calls that share a 1k-token prefix (bench/shared_prefix_calls.py: a
document, then a question of their own), sent open-loop by `zeroqueue pulse` to a deadline-mode replica with the
cache on, then to one with it off (`--no-prefix-cache`), one replica at a time.

Per mode, on one replica (its cache warmed by one call first, as a tenant's earlier call warms it):
  1. a sweep of Poisson rates (cache on only): the knee is the highest rate refusing at most --knee-rejection of
     first attempts (pulse's own definition of capacity; its --capacity search sends plain calls only);
  2. the load run at --load × the knee: admitted, refused, and the admitted calls' deadlines met, as the client saw
     them and as the replica logged them (request_done's deadline_met);
  3. the tight run: budgets of --tight-deadline-ms, which the uncached prefill alone exceeds on this host; with the
     cache they fit, so they are admitted, and without it refused at once as infeasible.
The model is the SmolLM2-135M shape (bench/decode.py) with --max-seq-len 2048. stdout: one JSON document.

    python bench/prefix_cache_load.py --out bench/results/prefix-cache-load-<date>
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from board import host  # noqa: E402
from decode import make_model  # noqa: E402
from shared_prefix_calls import document, request_lines  # noqa: E402

from services.client import Client  # noqa: E402
from services.pulse.replicas import start_replica  # noqa: E402

SERVE_ARGS = [
    "--max-seq-len",
    "2048",
    "--max-batch",
    "4",
]  # 4 slots: a knee the load generator, on the same cores, can double


def write_calls(path: Path, prefix_tokens: int, max_tokens: int) -> str:
    """The request file; returns the shared prefix."""
    prefix = document(prefix_tokens)
    path.write_text("\n".join(request_lines(prefix, max_tokens)) + "\n")
    return prefix


def pulse(replica, calls: Path, qps: float, duration_s: float, deadline_ms: int, out: Path) -> dict:
    """One open-loop run against the replica; the client's counts and the replica's log for the run."""
    log_lines = replica.log_path.read_text().count("\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "pulse",
            "--endpoint",
            replica.address,
            "--api-key",
            replica.api_key,
            "--metrics-url",
            replica.metrics_url,
            "--request-file",
            str(calls),
            "--qps",
            str(qps),
            "--duration",
            str(duration_s),
            "--deadline-ms",
            str(deadline_ms),
            "--max-attempts",
            "1",
            "--out",
            str(out),
            "--no-plots",
            "--no-progress",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    time.sleep(1.0)  # the last request_done lines
    traces = [json.loads(line) for path in out.glob("trace-*.jsonl") for line in path.read_text().splitlines()]
    outcomes = Counter(t["outcome"] for t in traces)
    causes = Counter(t["refusal_cause"] for t in traces if t.get("refusal_cause"))
    done = [
        json.loads(line)
        for line in replica.log_path.read_text().splitlines()[log_lines:]
        if line.startswith("{") and '"request_done"' in line
    ]
    admitted = [t for t in traces if t["outcome"] in ("ok", "deadline_exceeded")]
    met = sum(1 for t in admitted if t["outcome"] == "ok" and t.get("server_deadline_met"))
    return {
        "qps": qps,
        "duration_s": duration_s,
        "deadline_ms": deadline_ms,
        "sent": len(traces),
        "outcomes": dict(outcomes),
        "refusal_causes": dict(causes),
        "first_attempt_refused": round(1 - len(admitted) / max(len(traces), 1), 4),
        "admitted": len(admitted),
        "client_deadline_met": met,
        "replica_request_done": len(done),
        "replica_deadline_met": sum(1 for d in done if d.get("deadline_met")),
        "replica_cached_prompt_tokens": sum(d.get("cached_prompt_tokens") or 0 for d in done),
        "replica_prompt_tokens": sum(d.get("prompt_tokens") or 0 for d in done),
    }


def warm(replica, prefix: str) -> None:
    """One call computes the shared prefix, as a tenant's first question about a document does."""
    with Client([replica.address], api_key=replica.api_key) as client:
        client.complete(prefix + "\n# Q: warm\n# A:", deadline_ms=60_000, max_tokens=1)


def run_mode(args, name: str, extra: list[str], calls: Path, prefix: str, rates: list[float] | None, load_qps):
    out = args.out / name
    replica = start_replica(args.model, "deadline", out, [*SERVE_ARGS, *extra], name=name)
    try:
        warm(replica, prefix)
        result: dict = {"sweep": []}
        for qps in rates or []:
            result["sweep"].append(pulse(replica, calls, qps, args.sweep_s, args.deadline_ms, out / f"sweep-{qps}"))
        if rates:
            fits = [r["qps"] for r in result["sweep"] if r["first_attempt_refused"] <= args.knee_rejection]
            result["knee_qps"] = knee = max(fits) if fits else min(rates)
            load_qps = round(args.load * knee, 2)
        result["load"] = pulse(replica, calls, load_qps, args.load_s, args.deadline_ms, out / "load")
        result["tight"] = pulse(replica, calls, args.tight_qps, args.tight_s, args.tight_deadline_ms, out / "tight")
        return result, load_qps
    finally:
        replica.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="default: the SmolLM2-135M shape")
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rates", default="2,3,4,5,6", help="the sweep's Poisson rates, calls/s")
    parser.add_argument("--knee-rejection", type=float, default=0.03)
    parser.add_argument("--load", type=float, default=2.0, help="the load run's rate, × the knee")
    parser.add_argument("--sweep-s", type=float, default=20.0)
    parser.add_argument("--load-s", type=float, default=150.0)
    parser.add_argument("--deadline-ms", type=int, default=5000)
    parser.add_argument("--tight-deadline-ms", type=int, default=1000)
    parser.add_argument("--tight-qps", type=float, default=2.0)
    parser.add_argument("--tight-s", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "prefix-cache-load")
    args = parser.parse_args()
    args.model = args.model or make_model()
    args.out.mkdir(parents=True, exist_ok=True)
    calls = args.out / "calls.jsonl"
    prefix = write_calls(calls, args.prefix_tokens, args.max_tokens)
    rates = [float(r) for r in args.rates.split(",")]
    on, load_qps = run_mode(args, "cache-on", [], calls, prefix, rates, None)
    off, _ = run_mode(args, "cache-off", ["--no-prefix-cache"], calls, prefix, None, load_qps)
    report = {
        "host": host(),
        "serve_args": SERVE_ARGS,
        "args": {k: str(v) for k, v in vars(args).items()},
        "cache_on": on,
        "cache_off": off,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
