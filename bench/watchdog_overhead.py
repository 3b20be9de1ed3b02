"""The device watchdog's cost (goal: < 0.5 % of step time at full load), and its probe's.

At full load the watchdog times every step (health/watchdog.py: `WatchedExecutor.run`, its `begin`/`end` and the
median of the last steps) and runs no probe. Measured two ways on the same engine in one run:

  - side by side: blocks of decode steps at `--batch` take turns between the bare executor and the watched one
    (shuffled cycles, as bench/metering_overhead.py does), and the median step intervals are compared;
  - in place: in every watched step, the watched `run` less the device's own `run` inside it (the watchdog's
    bookkeeping, with the caches as a real step leaves them: in a tight loop it looks several times cheaper).

The probe runs only while the engine idles, once a period (100 ms): its median time is what an arrival can wait
for behind it, and its share of the period what an idle replica spends on it.

    python bench/watchdog_overhead.py [--model DIR] [--batch 8] [--steps 1000 per arm]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

from services.inference.device.executor import Executor, ExecutorConfig  # noqa: E402
from services.inference.device.loader import load_checkpoint  # noqa: E402
from services.inference.engine.calibration import calibrate  # noqa: E402
from services.inference.engine.engine import Engine  # noqa: E402
from services.inference.health.watchdog import Watchdog, WatchdogConfig, WatchedExecutor, probe_us  # noqa: E402
from services.inference.sched.request import Request, SamplingParams  # noqa: E402
from services.logs import configure_logging  # noqa: E402

DEFAULT_MODEL = ROOT / "services/inference/bundled/zq-python-tiny"
BLOCK_STEPS = 7
ARMS = ("bare", "watched")


class Stopwatch:
    """Between the watched executor and the device: times the device's own part of each watched step, so that the
    watchdog's part is the rest (its own two clock reads are charged to the watchdog)."""

    def __init__(self, executor) -> None:
        self.executor, self.last_ns = executor, 0

    def run(self, step):
        started_ns = time.perf_counter_ns()
        try:
            return self.executor.run(step)
        finally:
            self.last_ns = time.perf_counter_ns() - started_ns

    def probe(self) -> None:
        self.executor.probe()


def keep_busy(engine: Engine, batch: int, n: int) -> int:
    while engine.scheduler.num_unfinished + len(engine._inbox) < batch:  # noqa: SLF001 - the bench's own engine
        sampling = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        engine.add_request(Request(f"r{n}", tuple(range(1, 17)), sampling, time.monotonic_ns()), NullSink())
        n += 1
    return n


class NullSink:
    def put(self, output) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    checkpoint = load_checkpoint(args.model)
    executor = Executor(checkpoint, ExecutorConfig(max_batch=args.batch, max_seq_len=512))
    engine = Engine(executor, checkpoint.tokenizer, checkpoint.eos_token_ids)
    cost = calibrate(engine)
    watchdog = Watchdog(WatchdogConfig(), lambda *verdict: None)
    # both arms through the same two stopwatches; only the watched one has the watchdog between them
    inner = {"bare": Stopwatch(executor), "watched": Stopwatch(executor)}
    arms = {
        "bare": Stopwatch(inner["bare"]),
        "watched": Stopwatch(WatchedExecutor(inner["watched"], watchdog, cost, probe_us(executor))),
    }
    between_us: dict[str, list[float]] = {arm: [] for arm in ARMS}  # outer stopwatch less inner, per step
    steps_us: dict[str, list[float]] = {arm: [] for arm in ARMS}
    n, rng, order = 0, random.Random(0), list(ARMS)
    watchdog.start()  # its judge thread ticks as in a replica
    try:
        while min(map(len, steps_us.values())) < args.steps:
            block = sum(map(len, steps_us.values())) // BLOCK_STEPS
            if block % len(ARMS) == 0:
                order = rng.sample(ARMS, len(ARMS))
            arm = order[block % len(ARMS)]
            engine.executor = arms[arm]
            n = keep_busy(engine, args.batch, n)
            report = engine.step()
            if report is not None and report.result is not None:
                steps_us[arm].append(report.interval_ns / 1000)
                between_us[arm].append((arms[arm].last_ns - inner[arm].last_ns) / 1000)
        probe_median = probe_us(executor, repeats=201)  # the watchdog's own calibration of the probe
    finally:
        watchdog.stop()
    per_step_us = statistics.median(between_us["watched"]) - statistics.median(between_us["bare"])
    median_step = statistics.median(steps_us["bare"])
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "model": args.model.name,
                "batch": args.batch,
                "steps_per_arm": {arm: len(v) for arm, v in steps_us.items()},
                "step_us_median": {arm: round(statistics.median(v), 1) for arm, v in steps_us.items()},
                "side_by_side_pct": round(100 * (statistics.median(steps_us["watched"]) / median_step - 1), 3),
                "between_stopwatches_us_median": {a: round(statistics.median(v), 2) for a, v in between_us.items()},
                "watchdog_us_per_step": round(per_step_us, 2),
                "watchdog_pct_of_step": round(100 * per_step_us / median_step, 3),
                "probe_us_median": round(probe_median, 1),
                "probe_pct_of_idle_period": round(100 * probe_median / (WatchdogConfig().period_s * 1e6), 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    main()
