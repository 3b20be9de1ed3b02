"""A burst's prompts on the virtual replica (tests/inference/steady_device.py): a device that runs exactly as its
calibration says, no clock and no engine, so the same decisions every run and no host's noise. Two calibrations
measured on real replicas (the SmolLM2-135M shape's and the bundled model's, tests/inference/test_burst_prompts.py),
32 slots, 256 tokens a step; 64 + 32 tokens a call; Poisson arrivals and bursts (a second's worth at once, every
second) at multiples of each device's capacity; clients that never retry and clients that retry at the hint up to 8
times; a FIFO queue on the same seeded schedule (its clients give up at their deadline) beside deadline admission
with each variant of its settings.

    python bench/burst_virtual.py                          # this checkout: FIFO, --no-hold-prompts, the default
    python bench/burst_virtual.py --tree /tmp/before --variants hold_prompts=hold_for_prompts=True

`--tree` imports admission from another checkout (a worktree of an earlier commit), with this checkout's virtual
replica and calibrations. stdout is the Markdown table: goodput (calls finished in deadline per second, the mean over
seeds and attempts), and per variant the admitted calls that missed, of all admitted, summed.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_variants(text: str) -> dict[str, dict[str, bool]]:
    """'name=setting=True,setting=False;name2=' -> {name: {setting: value}}; an empty variant is the default."""
    variants = {}
    for item in filter(None, text.split(";")):
        name, _, settings = item.partition("=")
        pairs = (s.split("=") for s in filter(None, settings.split(",")))
        variants[name] = {key: value == "True" for key, value in pairs}
    return variants


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose admission is judged")
    parser.add_argument("--variants", default="no_hold_prompts=hold_for_prompts=False;default=")
    parser.add_argument("--loads", default="0.7,1,2,4")
    parser.add_argument("--budgets", default="2000,4000")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--seconds", type=float, default=20.0)
    ns = parser.parse_args()
    sys.path[:0] = [str(ns.tree), str(ns.tree / "protos")]
    from services.inference.admission import AdmissionConfig, AdmissionController, AdmissionSettings, FifoAdmission  # noqa: PLC0415  (from --tree)

    sys.path[:0] = [str(ROOT)]
    from tests.inference.steady_device import run  # noqa: PLC0415  (this checkout's virtual replica)
    from tests.inference.test_burst_prompts import DEVICES, cost  # noqa: PLC0415

    variants = parse_variants(ns.variants)
    print("| device | arrivals | load | budget, ms | FIFO | " + " | ".join(variants) + " |")
    print("|---|---|---:|---:|---:|" + "---:|" * len(variants))
    misses = {name: [0, 0] for name in variants}
    for device, budget_ms, every, load in itertools.product(
        DEVICES, map(int, ns.budgets.split(",")), (None, 1.0), map(float, ns.loads.split(","))
    ):
        goodput = {name: 0.0 for name in ("fifo", *variants)}
        runs = list(itertools.product((1, 8), map(int, ns.seeds.split(","))))
        for attempts, seed in runs:
            rate = load * DEVICES[device][2]
            kw = dict(seed=seed, max_attempts=attempts, budget_ms=budget_ms, burst_every_s=every)
            fifo = run(FifoAdmission(), rate, ns.seconds, device=(cost(device), 32, 256), **kw)
            goodput["fifo"] += fifo.goodput(ns.seconds) / len(runs)
            for name, settings in variants.items():
                controller = AdmissionController(cost(device), AdmissionConfig(32, 256), AdmissionSettings(**settings))
                tally = run(controller, rate, ns.seconds, **kw)
                goodput[name] += tally.goodput(ns.seconds) / len(runs)
                misses[name][0] += len(tally.misses)
                misses[name][1] += tally.num_admitted
        cells = " | ".join(f"{goodput[name]:.2f}" for name in ("fifo", *variants))
        print(f"| {device} | {'bursts' if every else 'Poisson'} | {load:g}× | {budget_ms} | {cells} |", flush=True)
    print("\nadmitted calls that missed: " + ", ".join(f"{n} {m} of {a}" for n, (m, a) in misses.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
