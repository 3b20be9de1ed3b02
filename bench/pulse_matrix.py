"""The pulse matrix of issue 5: capacity first (the closed-loop saturation, then the knee: the highest Poisson
rate refusing at most 2 % of first attempts), then deadline vs fifo at 0.5×, 1×, 2× and 4× of the knee, and a
Markdown table of the results against the goals, ready for BENCHMARKS.md.

Every step is a `zeroqueue pulse` command (printed before it runs), so any cell can be rerun by hand.
Takes roughly (4 × 2 × duration) + 5 probes × 20 s + 1-3 confirmations × duration + 9 replica warm-ups; run it on a
quiet machine.

    nice -n 5 .venv/bin/python bench/pulse_matrix.py --duration 60 --out bench/results/pulse
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

LOADS = (0.5, 1, 2, 4)


def pulse(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "services.cli", "pulse", *args]
    print("+ zeroqueue pulse " + " ".join(shlex.quote(a) for a in args), flush=True)
    subprocess.run(cmd, check=True)


def common(ns: argparse.Namespace) -> list[str]:
    out = [
        "--shape",
        "fixed",
        "--prompt-tokens",
        str(ns.prompt_tokens),
        "--max-tokens",
        str(ns.max_tokens),
        "--deadline-ms",
        str(ns.deadline_ms),
        "--seed",
        str(ns.seed),
        "--no-progress",
    ]
    if ns.model:
        out += ["--model", ns.model]
    if ns.serve_args:
        out += [f"--serve-args={ns.serve_args}"]
    return out


def _f(value, fmt="{:.2f}") -> str:
    return "—" if value is None else fmt.format(value)


def table(out: Path) -> str:
    capacity = json.loads((out / "capacity" / "capacity.json").read_text())
    runs = {load: json.loads((out / f"load-{load}x" / "pulse.json").read_text())["runs"] for load in LOADS}
    goodput_1x = runs[1]["deadline"]["summary"]["goodput_rps"]
    probes = ", ".join(f"{p['qps']:.1f} → {100 * p['rejection_rate']:.1f} %" for p in capacity.get("probes", []))
    confirmations = capacity.get("confirmations") or []
    if confirmations:
        band = f"{100 * capacity.get('knee_min_rejection', 0):.1f}–{100 * capacity['knee_rejection']:.0f} %"
        probes += (
            f"; runs of {capacity['confirm_duration_s']:.0f} s looking for {band}: "
            + ", ".join(f"{p['qps']:.1f} → {100 * p['rejection_rate']:.1f} %" for p in confirmations)
            + ("" if capacity.get("confirmed") else ", none in the band")
        )
    lines = [
        f"Capacity (1×): {capacity['capacity_qps']:.2f} req/s, the knee: the highest Poisson rate refusing at "
        f"most {100 * capacity.get('knee_rejection', 0):.0f} % of first attempts (probes of "
        f"{capacity.get('probe_duration_s', 0):.0f} s, rate → refused: {probes}). Saturation: "
        f"{capacity.get('saturation_qps', capacity['capacity_qps']):.2f} req/s ({capacity['concurrency']} "
        f"closed-loop callers). Shape {capacity['shape']['prompt_tokens']}+{capacity['shape']['max_tokens']} "
        f"tokens, deadline {capacity['deadline_ms']:.0f} ms.",
        "",
        "| load | mode | in deadline of admitted | P99/P50 admitted (at the replica) "
        "| queue mean / step time mean / step period mean, ms | joined the "
        "next step | rejection rate | first-retry success | avg retries | goodput req/s | goodput vs fifo "
        "| goodput vs 1× |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for load in LOADS:
        for mode in ("deadline", "fifo"):
            s, server = runs[load][mode]["summary"], runs[load][mode].get("server") or {}
            miss = s["admitted_miss_rate"]
            fifo = runs[load]["fifo"]["summary"]["goodput_rps"]
            vs_fifo = s["goodput_rps"] / fifo if mode == "deadline" and fifo else None
            vs_1x = s["goodput_rps"] / goodput_1x if mode == "deadline" and goodput_1x else None
            lines.append(
                f"| {load}× | {mode} | {_f(None if miss is None else 100 * (1 - miss), '{:.2f} %')} "
                f"| {_f(s['p99_over_p50'])} ({_f(s.get('server_p99_over_p50'))}) "
                f"| {_f(server.get('queue_time', {}).get('mean_ms'))} / "
                f"{_f(server.get('step_time', {}).get('mean_ms'))} / "
                f"{_f(server.get('step_period', {}).get('mean_ms'))} "
                f"| {_f(_pct(server.get('steps_waited', {}).get('next_step_share')), '{:.2f} %')} "
                f"| {_f(_pct(s['rejection_rate']), '{:.2f} %')} "
                f"| {_f(_pct(s['first_retry_success_rate']), '{:.2f} %')} | {_f(s['avg_retries_per_rejected'])} "
                f"| {_f(s['goodput_rps'])} | {_f(vs_fifo, '{:.2f}×')} | {_f(vs_1x, '{:.2f}')} |"
            )
    return "\n".join(lines)


def _pct(value):
    return None if value is None else 100 * value


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/pulse")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    p.add_argument("--capacity-duration", type=float, default=30.0, help="seconds of the closed-loop saturation run")
    p.add_argument("--probe-duration", type=float, default=20.0, help="seconds of each knee probe")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--deadline-ms", type=float, default=2_000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--serve-args", default="", help="extra `zeroqueue serve` arguments for every replica")
    p.add_argument("--table-only", action="store_true", help="only print the table of an existing --out")
    ns = p.parse_args()
    out = Path(ns.out)
    if not ns.table_only:
        pulse(
            [
                "--capacity",
                "--duration",
                str(ns.capacity_duration),
                "--probe-duration",
                str(ns.probe_duration),
                "--confirm-duration",
                str(ns.duration),
                "--out",
                str(out / "capacity"),
                *common(ns),
            ]
        )
        for load in LOADS:
            pulse(
                [
                    "--compare",
                    "--load",
                    str(load),
                    "--capacity-json",
                    str(out / "capacity" / "capacity.json"),
                    "--duration",
                    str(ns.duration),
                    "--out",
                    str(out / f"load-{load}x"),
                    *common(ns),
                ]
            )
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
