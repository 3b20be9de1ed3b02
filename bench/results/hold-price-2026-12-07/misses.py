"""The cells of bench/burst_virtual.py where holding (`hold_in_slack`) lets an admitted call miss, with the
admission events of that run. With hold-price.patch applied:

    python bench/results/hold-price-2026-12-07/misses.py HOLD_SLACK_RUNS      # 1: the setting's default
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "protos")]
    from services.inference.admission import AdmissionConfig, AdmissionController, AdmissionSettings  # noqa: PLC0415
    from tests.inference.steady_device import run  # noqa: PLC0415
    from tests.inference.test_burst_prompts import DEVICES, cost  # noqa: PLC0415

    settings = AdmissionSettings(hold_in_slack=True, hold_slack_runs=float(sys.argv[1]))
    cells = itertools.product(DEVICES, (2000, 4000), (None, 1.0), (0.7, 1, 2, 4), (1, 8), (1, 2))
    for device, budget_ms, every, load, attempts, seed in cells:
        c = AdmissionController(cost(device), AdmissionConfig(32, 256), settings)
        rate = load * DEVICES[device][2]
        t = run(c, rate, 20.0, seed=seed, max_attempts=attempts, budget_ms=budget_ms, burst_every_s=every)
        if t.misses:
            arrivals = "bursts" if every else "poisson"
            print(device, budget_ms, arrivals, load, attempts, seed, t.misses, dict(c.events))


if __name__ == "__main__":
    main()
