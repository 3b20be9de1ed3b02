"""Holding calls in their slack on the virtual replica (tests/inference/steady_device.py): a device that runs
exactly as its calibration says (the SmolLM2-135M shape's, 32 slots, 256 tokens a step), Poisson arrivals of
64 + 32 tokens, the same seeded schedule against a FIFO queue (its clients give up at their deadline), deadline
admission that refuses what does not fit now (`--no-hold`) and deadline admission that holds (the default). No
clock and no engine: the same decisions every run, so it isolates the policy from the host's noise.

    python bench/slack_virtual.py --budgets 2000,4000 --attempts 1

stdout is the Markdown table: goodput (calls finished in deadline per second) and admitted misses per cell.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

from services.inference.admission import FifoAdmission  # noqa: E402
from services.inference.cost.model import CostModel  # noqa: E402
from tests.inference.steady_device import run  # noqa: E402
from tests.inference.test_retry_invitations import CAPACITY_PER_S, ROW_US, ROWS, replica  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", default="0.7,1,2,4", help=f"multiples of the capacity ({CAPACITY_PER_S} calls/s)")
    parser.add_argument("--budgets", default="2000,4000", help="deadlines in ms (a run is ~0.6 s at load)")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--attempts", type=int, default=1, help="attempts a refused call makes (1: no retry)")
    parser.add_argument("--seconds", type=float, default=30.0)
    ns = parser.parse_args()
    device = (CostModel(list(ROWS), list(ROW_US), 1.975), 32, 256)
    print("| budget | load | seed | fifo, req/s | refuse, req/s (misses) | hold, req/s (misses) | hold vs fifo |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for budget_ms in (int(b) for b in ns.budgets.split(",")):
        for load in (float(x) for x in ns.loads.split(",")):
            for seed in (int(x) for x in ns.seeds.split(",")):
                rate, kw = load * CAPACITY_PER_S, dict(seed=seed, max_attempts=ns.attempts, budget_ms=budget_ms)
                fifo = run(FifoAdmission(), rate, ns.seconds, device=device, **kw)
                refusing = run(replica(hold=False), rate, ns.seconds, **kw)
                held = run(replica(hold=True), rate, ns.seconds, **kw)
                g = [t.goodput(ns.seconds) for t in (fifo, refusing, held)]
                print(
                    f"| {budget_ms} | {load:g}× | {seed} | {g[0]:.2f} | {g[1]:.2f} ({len(refusing.misses)}) | "
                    f"{g[2]:.2f} ({len(held.misses)}) | {g[2] / g[0]:.2f}× |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
