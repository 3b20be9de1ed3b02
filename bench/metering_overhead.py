"""Metering's cost to the engine step (goal: < 1 % of step time).

Runs batches of greedy requests through the engine with the meter attached as `zeroqueue serve` attaches it
(an observer called in the step, handing records to a real outbox on disk):

    python bench/metering_overhead.py [--model DIR] [--batch 8] [--steps 600 per arm]

Blocks of 7 steps take turns with an empty observer and with no observer at all, so the steps' own times can
be compared too, against a control. Reported: each call's time against its step's interval (the call runs
after the interval closes; the next step's interval is billed from there), and the median and mean step
interval of each arm. The outbox's group commit runs on
a third thread: it delays a call's final message, not the engine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

from services.inference.clock import Clock  # noqa: E402
from services.inference.engine import Engine  # noqa: E402
from services.inference.executor import Executor, ExecutorConfig  # noqa: E402
from services.inference.loader import load_checkpoint  # noqa: E402
from services.inference.meter import Device, Meter, RecordContext  # noqa: E402
from services.inference.request import Request, SamplingParams  # noqa: E402
from services.metering.outbox import Outbox  # noqa: E402

DEFAULT_MODEL = ROOT / "services/inference/bundled/zq-python-tiny"
BLOCK_STEPS = 7                 # prime to a request's 17 steps, so arms see every phase of its life


class Timed:
    """Wraps an observer and keeps how long each of its step calls took, with the step's interval."""

    def __init__(self, observer) -> None:
        self.observer, self.call_us, self.step_us = observer, [], []

    def on_step(self, report) -> None:
        t0 = time.perf_counter_ns()
        self.observer.on_step(report)
        self.call_us.append((time.perf_counter_ns() - t0) / 1000)
        self.step_us.append(report.interval_ns / 1000)

    def on_idle(self, now_ns: int, **kwargs) -> None:
        self.observer.on_idle(now_ns, **kwargs)


class Null:
    """An observer that does nothing: the control arm, timed the same way as the meter."""

    def on_step(self, report) -> None:
        pass

    def on_idle(self, now_ns: int, **kwargs) -> None:
        pass


class Discard:
    def put(self, output) -> None:
        pass


def pct(calls: list[float], steps: list[float]) -> dict[str, float]:
    ratios = [c / s for c, s in zip(calls, steps)]
    return {"us_median": round(statistics.median(calls), 1), "us_p99": round(sorted(calls)[int(0.99 * len(calls))], 1),
            "pct_median": round(100 * statistics.median(ratios), 3), "pct_mean": round(100 * statistics.mean(ratios), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    checkpoint = load_checkpoint(args.model)
    executor = Executor(checkpoint, ExecutorConfig(max_batch=args.batch, max_seq_len=512))
    clock = Clock()
    engine = Engine(executor, checkpoint.tokenizer, checkpoint.eos_token_ids, clock=clock.now_ns)
    info = executor.info
    device = Device(info.kind, info.device_id, info.unit, info.num_compute_units)
    with tempfile.TemporaryDirectory() as tmp:
        outbox = Outbox(Path(tmp) / "outbox.db")
        meter = Meter(device, "bench", clock.epoch_us, outbox.append, started_ns=clock.now_ns())
        timed = Timed(meter)
        # blocks of steps take turns: metered as served, an empty observer timed the same way (the control:
        # how far arms differ by chance), and no observer (records of calls that end outside the meter's
        # blocks are not made: the bench times the meter, it bills nobody)
        null = Timed(Null())
        arms = {"meter": [timed], "null": [null], "none": []}
        steps_us: dict[str, list[float]] = {arm: [] for arm in arms}
        n, t_end = 0, time.monotonic() + 600
        while sum(map(len, steps_us.values())) < len(arms) * args.steps and time.monotonic() < t_end:
            arm = list(arms)[(sum(map(len, steps_us.values())) // BLOCK_STEPS) % len(arms)]
            engine.observers[:] = arms[arm]
            while engine.scheduler.num_unfinished + len(engine._inbox) < args.batch:
                rid = f"r{n}"
                context = RecordContext("bench", {"team": "bench"}, checkpoint.name, clock.now_epoch_us(),
                                        clock.now_epoch_us(), clock.now_epoch_us() + 10**9)
                meter.register(rid, context)
                engine.add_request(Request(rid, (1, 2, 3, 4, 5, 6, 7, 8), SamplingParams(
                    max_tokens=16, temperature=0.0, ignore_eos=True), clock.now_ns()), Discard())
                n += 1
            report = engine.step()
            if report is not None:
                steps_us[arm].append(report.interval_ns / 1000)
        meter.on_idle(clock.now_ns(), final=True)
        t0 = time.perf_counter()
        outbox.flush()
        flush_ms = (time.perf_counter() - t0) * 1000
        counts = outbox.counts()
        outbox.close()
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": args.model.name, "batch": args.batch,
        "steps_per_arm": {arm: len(v) for arm, v in steps_us.items()}, "records": counts,
        "step_us_median": {arm: round(statistics.median(v), 1) for arm, v in steps_us.items()},
        "step_us_mean": {arm: round(statistics.mean(v), 1) for arm, v in steps_us.items()},
        "meter_call": pct(timed.call_us, timed.step_us),
        "null_call": pct(null.call_us, null.step_us),
        "final_outbox_flush_ms": round(flush_ms, 2)}, indent=2))


if __name__ == "__main__":
    main()
