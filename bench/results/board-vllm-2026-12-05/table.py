"""The BENCHMARKS.md table of issue 35's comparison against vLLM, from bench/http_pulse.py's results.json files.

    python bench/results/board-vllm-2026-12-05/table.py bench/results/board-vllm-2026-12-05/run1 [.../run2-1x ...]

Columns: goodput (calls answered inside their 2-s deadline per second of schedule), zeroqueue ÷ vLLM in the same
run, 429s (calls whose first attempt was refused; calls that ended refused after the SDK's retries), calls served in
deadline of those sent, P50 / P99 latency of answered calls (call start -> answer, retry waits included), and for
zeroqueue calls answered late / for vLLM calls the client dropped at their deadline.
"""

import json
import sys
from pathlib import Path


def main() -> None:
    print(
        "| run | load (req/s) | engine | goodput, req/s | zeroqueue ÷ vLLM | 429 at first attempt / ended refused "
        "| served in deadline (of sent) | P50 / P99 latency, ms | timed out / late |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for d in sys.argv[1:]:
        rows = json.loads((Path(d) / "results.json").read_text())["rows"]
        vllm = {r["load"]: r["goodput_rps"] for r in rows if r["engine"] == "vllm"}
        for r in sorted(rows, key=lambda r: (r["load"], r["engine"] != "zeroqueue")):
            refused_end = r["outcomes"].get("rejected", 0)
            sent = r["sent"]
            if r["engine"] == "zeroqueue":
                base = vllm.get(r["load"])
                ratio = "—" if base is None else ("∞ (vLLM 0)" if base == 0 else f"{r['goodput_rps'] / base:.2f}×")
                refused = f"{r['rejection_rate'] * 100:.1f} % / {refused_end} ({refused_end / sent * 100:.1f} %)"
            else:
                ratio, refused = "", "— (never refuses)"
            p50, p99 = r["latency_p50_ms"], r["latency_p99_ms"]
            lat = "—" if p50 is None else f"{p50:,.0f} / {p99:,.0f}"
            print(
                f"| {Path(d).name} | {r['load']:g}× ({r['qps']:.2f}) | {r['engine']} | **{r['goodput_rps']:.2f}** "
                f"| {ratio} | {refused} | {r['in_deadline']} / {sent} ({r['in_deadline'] / sent * 100:.1f} %) "
                f"| {lat} | {r['timed_out']} / {r['completed_late']} |"
            )


if __name__ == "__main__":
    main()
