"""The BENCHMARKS.md table of issue 35's comparison against vLLM, from bench/http_pulse.py's results.json files:
each argument a comma-separated group of run directories on the same schedule (seed, length), the first holding
vLLM's rows; every zeroqueue row of a group is divided by that vLLM run's goodput at the same load.

    R=bench/results/board-vllm-2026-12-07
    python $R/table.py $R/seed1-default-vllm,$R/seed1-hold $R/seed2-default-vllm,$R/seed2-hold
"""

import json
import sys
from pathlib import Path


def rows_of(d: str) -> list[dict]:
    return json.loads((Path(d) / "results.json").read_text())["rows"]


def main() -> None:
    print(
        "| run | load (req/s) | engine | goodput, req/s | zeroqueue ÷ vLLM | 429 at first attempt / ended refused "
        "| served in deadline (of sent) | P50 / P99 latency, ms | timed out / late |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for group in sys.argv[1:]:
        dirs = group.split(",")
        vllm = {r["load"]: r["goodput_rps"] for r in rows_of(dirs[0]) if r["engine"] == "vllm"}
        table = [(Path(d).name, r) for d in dirs for r in rows_of(d)]
        for name, r in sorted(table, key=lambda t: (t[1]["load"], t[1]["engine"] == "vllm", t[0])):
            refused_end, sent = r["outcomes"].get("rejected", 0), r["sent"]
            if r["engine"] == "zeroqueue":
                base = vllm.get(r["load"])
                ratio = "—" if base is None else ("∞ (vLLM 0)" if base == 0 else f"{r['goodput_rps'] / base:.2f}×")
                refused = f"{r['rejection_rate'] * 100:.1f} % / {refused_end} ({refused_end / sent * 100:.1f} %)"
                engine = "zeroqueue --hold" if "hold" in name else "zeroqueue"
            else:
                ratio, refused, engine = "", "— (never refuses)", "vLLM"
            p50, p99 = r["latency_p50_ms"], r["latency_p99_ms"]
            lat = "—" if p50 is None else f"{p50:,.0f} / {p99:,.0f}"
            print(
                f"| {name} | {r['load']:g}× ({r['qps']:.2f}) | {engine} | **{r['goodput_rps']:.2f}** "
                f"| {ratio} | {refused} | {r['in_deadline']} / {sent} ({r['in_deadline'] / sent * 100:.1f} %) "
                f"| {lat} | {r['timed_out']} / {r['completed_late']} |"
            )


if __name__ == "__main__":
    main()
