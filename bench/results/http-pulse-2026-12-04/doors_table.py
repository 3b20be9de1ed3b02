"""The doors table of these runs, from each doors-Lx/pulse.json and its traces (.jsonl or .jsonl.gz):

python3 doors_table.py DIR 1 2 4
"""

import gzip
import json
import os
import sys
from collections import Counter


def traces(path: str) -> list[dict]:
    with open(path) if os.path.exists(path) else gzip.open(path + ".gz", "rt") as f:
        return [json.loads(line) for line in f]


def num(v, fmt: str = "{:.2f}") -> str:
    return "—" if v is None else fmt.format(v)


def pct(v) -> str:
    return "—" if v is None else f"{v * 100:.2f} %"


def main(root: str, loads: list[str]) -> None:
    print(
        "| load | mode | door | sent | in deadline | goodput, req/s | attainment of admitted (client) "
        "| admitted misses client / replica's counter | refused at first attempt | retries per refused call "
        "| first-retry success | admitted P50 / P99, ms | 504 after admission / client timeouts "
        "| scheduler lag max, ms |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for load in loads:
        d = json.load(open(f"{root}/doors-{load}x/pulse.json"))
        qps = d["config"]["load"]["qps"]
        for label, r in d["runs"].items():
            s, server = r["summary"], r.get("server") or {}
            mode, door = label.rsplit("-", 1)
            errors = Counter(
                t["error"]
                for t in traces(f"{root}/doors-{load}x/trace-{label}.jsonl")
                if t["outcome"] == "deadline_exceeded"
            )
            attainment = s["num_in_deadline"] / s["num_admitted"] if s["num_admitted"] else None
            p = s["admitted_latency_ms"]
            print(
                f"| {load}× ({qps:.1f}) | {mode} | {door} | {s['num_sent']:,} | {s['num_in_deadline']:,} "
                f"| {s['goodput_rps']:.2f} | {pct(attainment)} "
                f"| {s['num_admitted_misses']} / {server.get('deadline_misses', '—')} | {pct(s['rejection_rate'])} "
                f"| {num(s['avg_retries_per_rejected'])} | {pct(s['first_retry_success_rate'])} "
                f"| {num(p['p50'], '{:.0f}')} / {num(p['p99'], '{:.0f}')} "
                f"| {errors.get('DEADLINE_EXCEEDED/DEADLINE_MISSED', 0)} / "
                f"{errors.get('DEADLINE_EXCEEDED/CLIENT_TIMEOUT', 0)} | {num(s['max_dispatch_lag_ms'], '{:.0f}')} |"
            )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
