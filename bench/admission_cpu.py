"""What an admission decision costs in CPU when most calls are refused, and how much of a core that takes.

Drives the deadline-mode AdmissionController through the virtual-time overload of tests/inference/overload.py
(Poisson arrivals at load × ~85 calls/s of 64+32 tokens, 2-s deadlines, 32 slots, a step every 6 ms, refused
calls retrying at their hint) and times every `decide()` call with perf_counter_ns. No engine and no clock:
every run makes the same decisions, so two source trees can be compared side by side, interleaved, in one run
(`--tree` names the checkout whose services/ to import; the overload driver is always this one's).

    .venv/bin/python bench/admission_cpu.py                                   # this checkout
    .venv/bin/python bench/admission_cpu.py --tree /tmp/old --tree .          # before / after, interleaved
    .venv/bin/python bench/admission_cpu.py --mix both                        # two tenants, two classes

`--mix` says whose calls they are: `one` tenant of one class (the default); `tenants`, a flood (10 calls of 11)
beside a modest tenant (1 of 11), so fair share keeps headroom; `classes`, one tenant's interactive calls (1 of 7,
priority 50) among its batch calls (priority 0); `both`. A call's tenant and class follow from its id, so its
retries keep them; a tree whose Commitment has no priority sees every call in one class.

Reports per tree and load: decisions, the share refused, decide() µs mean / P50 / P99, and the CPU seconds
that decisions take per second of traffic (the share of a core the server's event loop spends deciding).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOADS = (1.0, 2.0, 4.0)
CHILD = """
import importlib.util, json, sys, time
sys.path.insert(0, {tree!r})
from services.inference.admission import AdmissionConfig, AdmissionController, Commitment, Reject
try:  # a tree from before the cost model had a room of its own (services/inference/cost/)
    from services.inference.cost.model import CostModel
except ImportError:
    from services.inference.admission.costmodel import CostModel
spec = importlib.util.spec_from_file_location("overload", {driver!r})
driver = importlib.util.module_from_spec(spec); spec.loader.exec_module(driver)
cost = CostModel(rows=[1, 8, 32, 96, 256], row_us=[2000, 2300, 3000, 4500, 8000], us_per_context_token=0.01)
controller = AdmissionController(cost, AdmissionConfig(32, 256, pace_tokens={pace}))
timings_ns, decide = [], controller.decide
tenants, classes = {mix!r} in ("tenants", "both"), {mix!r} in ("classes", "both") and "priority" in Commitment.__slots__
def timed(new, now_ns):
    n = int((new.key if hasattr(new, "key") else new.request_id)[1:])  # an older tree's Commitment: request_id
    if tenants:
        new.tenant = "modest" if n % 11 == 0 else "flood"
    if classes:
        new.priority = 50 if n % 7 == 0 else 0
    t0 = time.perf_counter_ns(); d = decide(new, now_ns); timings_ns.append(time.perf_counter_ns() - t0); return d
controller.decide = timed
refused = sum(isinstance(d[0], Reject) for d in driver.overload([controller], {load}, {seconds}))
print(json.dumps({{"timings_ns": timings_ns, "refused": refused}}))
"""


def run_once(tree: Path, load: float, seconds: float, pace: int, mix: str = "one") -> dict:
    code = CHILD.format(
        tree=str(tree),
        driver=str(ROOT / "tests" / "inference" / "overload.py"),
        load=load,
        seconds=seconds,
        pace=pace,
        mix=mix,
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tree)
    data = json.loads(out.stdout)
    t = sorted(data["timings_ns"])
    return {
        "decisions": len(t),
        "refused": data["refused"],
        "mean_us": statistics.fmean(t) / 1000,
        "p50_us": t[len(t) // 2] / 1000,
        "p99_us": t[min(int(0.99 * len(t)), len(t) - 1)] / 1000,
        "cpu_share": sum(t) / 1e9 / seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], help="checkout to import services/ from; repeatable")
    p.add_argument("--seconds", type=float, default=20.0, help="virtual seconds of arrivals per run")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions; the median is reported")
    p.add_argument("--pace-tokens", type=int, default=64)
    p.add_argument("--mix", choices=("one", "tenants", "classes", "both"), default="one", help="whose calls")
    p.add_argument("--loads", type=float, nargs="+", default=list(LOADS), help="× ~85 calls/s")
    args = p.parse_args()
    trees = [Path(t).resolve() for t in args.tree] or [ROOT]
    runs: dict[tuple[str, float], list[dict]] = {}
    for _ in range(args.reps):
        for load in args.loads:
            for tree in trees:
                runs.setdefault((str(tree), load), []).append(
                    run_once(tree, load, args.seconds, args.pace_tokens, args.mix)
                )
    rows = []
    for (tree, load), reps in runs.items():
        rows.append(
            {
                "tree": tree,
                "load": load,
                "decisions": reps[0]["decisions"],
                "refused": reps[0]["refused"],
                **{
                    k: round(statistics.median(r[k] for r in reps), 3)
                    for k in ("mean_us", "p50_us", "p99_us", "cpu_share")
                },
            }
        )
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                "python": platform.python_version(),
                "pace_tokens": args.pace_tokens,
                "mix": args.mix,
                "virtual_seconds": args.seconds,
                "reps": args.reps,
                "rows": rows,
            },
            indent=2,
        )
    )
    print("| tree | load | decisions | refused | decide µs mean / P50 / P99 | core share deciding |", file=sys.stderr)
    print("|---|---:|---:|---:|---:|---:|", file=sys.stderr)
    for r in rows:
        print(
            f"| {Path(r['tree']).name} | {r['load']:g}× | {r['decisions']:,} | {r['refused']:,} | "
            f"{r['mean_us']:.0f} / {r['p50_us']:.0f} / {r['p99_us']:.0f} | {100 * r['cpu_share']:.1f} % |",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
