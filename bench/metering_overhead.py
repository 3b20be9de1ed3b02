"""Metering's cost inside the engine step (goal: < 1 % of step time).

Runs batches of greedy requests through the engine with the meter attached (writing into a real outbox
on disk), timing the meter's own work in every step against the step, side by side in one run:

    python bench/metering_overhead.py [--model DIR] [--batch 8] [--steps 300]

The outbox commit happens on its own thread (group commit), so it is reported separately: it delays a
call's final message, not the engine.
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


class TimedMeter:
    """Wraps the meter and keeps how long each of its calls took."""

    def __init__(self, meter: Meter) -> None:
        self.meter, self.on_step_us, self.step_us, self.ended = meter, [], [], []

    def on_step(self, report) -> None:
        t0 = time.perf_counter_ns()
        self.meter.on_step(report)
        self.on_step_us.append((time.perf_counter_ns() - t0) / 1000)
        self.step_us.append(report.interval_ns / 1000)
        self.ended.append(bool(report.ended))

    def on_idle(self, now_ns: int) -> None:
        self.meter.on_idle(now_ns)


class Discard:
    def put(self, output) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    checkpoint = load_checkpoint(args.model)
    executor = Executor(checkpoint, ExecutorConfig(max_batch=args.batch, max_seq_len=512))
    clock = Clock()
    engine = Engine(executor, checkpoint.tokenizer, checkpoint.eos_token_ids, clock=clock.now_ns)
    with tempfile.TemporaryDirectory() as tmp:
        outbox = Outbox(Path(tmp) / "outbox.db")
        info = executor.info
        meter = Meter(Device(info.kind, info.device_id, info.unit, info.num_compute_units), "bench", clock.epoch_us,
                      outbox.append, started_ns=clock.now_ns())
        timed = TimedMeter(meter)
        engine.observers.append(timed)
        n, t_end = 0, time.monotonic() + 600
        while len(timed.step_us) < args.steps and time.monotonic() < t_end:
            while engine.scheduler.num_unfinished + len(engine._inbox) < args.batch:
                rid = f"r{n}"
                meter.register(rid, RecordContext("bench", {"team": "bench"}, checkpoint.name, clock.now_epoch_us(),
                                                  clock.now_epoch_us(), clock.now_epoch_us() + 10**9))
                engine.add_request(Request(rid, (1, 2, 3, 4, 5, 6, 7, 8), SamplingParams(
                    max_tokens=16, temperature=0.0, ignore_eos=True), clock.now_ns()), Discard())
                n += 1
            engine.step()
        t0 = time.perf_counter()
        outbox.flush()
        flush_ms = (time.perf_counter() - t0) * 1000
        counts = outbox.counts()
        outbox.close()
    overhead = [m / s for m, s in zip(timed.on_step_us, timed.step_us)]
    # steps where a request ended also hand its record to the outbox's writer thread
    by_kind = {kind: [m for m, e in zip(timed.on_step_us, timed.ended) if e == ended]
               for kind, ended in (("split_only", False), ("split_and_record", True))}
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": args.model.name, "batch": args.batch, "steps": len(timed.step_us), "records": counts,
        "step_us_median": round(statistics.median(timed.step_us), 1),
        "meter_us_median": round(statistics.median(timed.on_step_us), 1),
        "meter_us_p99": round(sorted(timed.on_step_us)[int(0.99 * len(timed.on_step_us))], 1),
        **{f"meter_us_median_{kind}": round(statistics.median(v), 1) if v else None for kind, v in by_kind.items()},
        **{f"steps_{kind}": len(v) for kind, v in by_kind.items()},
        "overhead_pct_median": round(100 * statistics.median(overhead), 3),
        "overhead_pct_mean": round(100 * statistics.mean(overhead), 3),
        "final_outbox_flush_ms": round(flush_ms, 2)}, indent=2))


if __name__ == "__main__":
    main()
