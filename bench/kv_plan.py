"""Blocks planned on admission's calendar, before and after: a replica whose KV pool holds fewer calls than its
slots could fill, under calls of mixed lengths (some near the full context), with the SDK's retries at the hint.

Each round runs the same seeded `zeroqueue pulse` schedule against a replica of each tree in turn (`--before`: a
git revision, checked out in a worktree beside this one; the other: this checkout), one replica at a time, the
trees' order alternating from round to round. Reported per run: the pulse's goodput, first attempts refused,
first-retry success and retries per refused call, the admitted calls that missed; and from the replica's own
/metrics, its refusals for KV blocks, with and without a reservation (`zeroqueue_refusals_total{cause="kv_blocks"}`
and the reservation events: `taken` retries admitted on time, `taken_refused` refused again).

    python bench/kv_plan.py --before 9b2fe85 --qps 6,10,14 --duration 30 --rounds 2

`--before .` compares this checkout with itself, `--before-args` and `--after-args` adding serve arguments to one
side each (`--before . --after-args=--hold`: holding calls in their slack against refusing them).

Prefix caching is off (`--no-prefix-cache`): calls that share no prefix, so what a call takes is what it gives
back. With `--shared-prefix N`, it is on, and the calls are questions about two documents of about N tokens each
(bench/shared_prefix_calls.py), so that the calls about one document share its blocks, which go back only with the
last of them (`--serve-args` sizes the pool: `--kv-memory 2MiB` is 41 blocks). The report is JSON on stdout;
progress and the replicas' logs go to stderr and the --out directory.

    python bench/kv_plan.py --before REV --shared-prefix 300 --serve-args="--kv-memory 2MiB" --qps 4,8
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "bench")]

from soak_checks import host_info  # noqa: E402  (bench/soak_checks.py)

from services.inference.bundled_model import default_model  # noqa: E402
from services.logs import configure_logging  # noqa: E402
from services.pulse.replicas import start_replica  # noqa: E402
from services.pulse.scrape import scrape  # noqa: E402

SECOND_DOCUMENT = ROOT / "services/inference/admission/checks.py"  # the other document questions are asked about
KEYS = ("goodput_rps", "rejection_rate", "first_retry_success_rate", "avg_retries_per_rejected", "num_admitted_misses")
SERVE = "--max-batch 8 --max-seq-len 512 --kv-memory 4MiB --no-prefix-cache"


def worktree(rev: str, path: Path) -> Path:
    """`rev` checked out at `path` (made once), with this checkout's compiled kernels: the sources they build from
    are the same, and a worktree has no build of its own."""
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True)
        build = ROOT / "services/inference/device/kernels/_build"
        if build.exists():
            (path / "services/inference/device/kernels/_build").symlink_to(build)
    return path


def counters(metrics_url: str) -> dict[str, float]:
    """The replica's refusals for KV blocks, its reservation events by name, and its deadline misses."""
    found: dict[str, float] = {}
    for (name, labels), value in scrape(metrics_url, timeout_s=10).items():
        label = dict(labels)
        if name == "zeroqueue_refusals_total" and label.get("cause") == "kv_blocks":
            found["kv_blocks_refusals"] = found.get("kv_blocks_refusals", 0.0) + value
        elif name == "zeroqueue_reservation_events_total":
            found[label["event"]] = value
        elif name == "zeroqueue_deadline_misses_total":
            found["replica_misses"] = value
    return found


def shared_prefix_file(num_tokens: int, max_tokens: int, path: Path) -> Path:
    """A pulse --request-file: each question of bench/shared_prefix_calls.py about two documents of ~num_tokens."""
    import shared_prefix_calls as calls  # noqa: PLC0415  (bench/: its tokenizer only when asked for)

    second = SECOND_DOCUMENT.read_text()[: len(calls.document(num_tokens))]
    lines = calls.request_lines(calls.document(num_tokens), max_tokens) + calls.request_lines(second, max_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def one_run(tree: Path, extra: str, args: argparse.Namespace, qps: float, run: Path) -> dict:
    """A replica of `tree`, the schedule against it, its summary and the replica's counters."""
    here = Path.cwd()
    os.chdir(tree)  # the replica runs `python -m services.cli serve` from its tree
    try:
        base = SERVE.replace(" --no-prefix-cache", "") if args.shared_prefix else SERVE
        serve = shlex.split(base) + shlex.split(args.serve_args) + shlex.split(extra)
        replica = start_replica(default_model(), "deadline", run, serve)
    finally:
        os.chdir(here)
    try:
        cmd = [sys.executable, "-m", "services.cli", "pulse", "--endpoint", replica.address, "--api-key"]
        cmd += [replica.api_key, "--metrics-url", replica.metrics_url, "--qps", str(qps), "--duration"]
        if args.shared_prefix:
            calls = shared_prefix_file(args.shared_prefix, 32, args.out / "calls.jsonl")
            cmd += [str(args.duration), "--request-file", str(calls)]
        else:
            cmd += [str(args.duration), "--shape", "mix", "--prompt-tokens", "120", "--max-tokens", "32"]
            cmd += ["--shape-sigma", "0.9"]
        cmd += ["--deadline-ms", str(args.deadline_ms), "--seed", str(args.seed)]
        cmd += ["--max-attempts", str(args.attempts), "--out", str(run / "pulse"), "--no-plots", "--no-progress"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        time.sleep(3)  # the last retries drain
        found = counters(replica.metrics_url)
    finally:
        replica.stop()
    summary = json.loads((run / "pulse" / "pulse.json").read_text())["runs"]["run"]["summary"]
    return {**{k: summary[k] for k in KEYS}, **{k: int(v) for k, v in sorted(found.items())}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the git revision to compare with this checkout")
    parser.add_argument("--qps", type=lambda t: [float(x) for x in t.split(",")], default=[6.0, 10.0, 14.0])
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--deadline-ms", type=float, default=3000.0)
    parser.add_argument("--attempts", type=int, default=8, help="the SDK's retries at the hint (8: its default)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve-args", default="", help="more `zeroqueue serve` arguments for both trees")
    parser.add_argument("--before-args", default="", help="more `zeroqueue serve` arguments for --before only")
    parser.add_argument("--after-args", default="", help="more `zeroqueue serve` arguments for this checkout only")
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens of a document calls share (0: none)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/kv_plan")
    args = parser.parse_args()
    before = ROOT if args.before == "." else worktree(args.before, Path(f"/tmp/zeroqueue-kv-plan-{args.before}"))
    trees = {"before": (before, args.before_args), "after": (ROOT, args.after_args)}
    result = {"host": host_info(), "serve": SERVE, "args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    for round_ in range(args.rounds):
        for qps in args.qps:
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for name in order:
                row = one_run(*trees[name], args, qps, args.out / f"round{round_}-qps{qps:g}-{name}")
                result["runs"].setdefault(f"{qps:g} req/s, {name}", []).append(row)
                print(f"round {round_}, {qps:g} req/s, {name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    sys.exit(main())
