"""Metering's cost to the engine step (goal: < 1 % of step time).

Runs batches of greedy requests through the engine and times, in each step, everything the step does for its
observers (`Engine._notify`: building the step digest and calling them), in blocks of 7 steps that take turns
among four arms:

  - meter-thread: the meter as `zeroqueue serve --engine-thread` attaches it, an observer called in the step
    (splitting the step, handing records to a real outbox on disk);
  - meter-process: what the engine process pays under plain `zeroqueue serve`, where the meter runs in the
    server process: the digest is built and pickled into the step's message (the outputs travel anyway);
  - null: an observer that does nothing (the control: how far the arms differ by chance);
  - none: no observer at all.

    python bench/metering_overhead.py [--model DIR] [--batch 8] [--steps 600 per arm]

Reported: the observer time against its step's interval (it runs after the interval closes; the next step's
interval is billed from there), and the median and mean step interval of each arm. The outbox's group commit
runs on another thread: it delays a call's final message, not the engine.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
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
BLOCK_STEPS = 7
# Each cycle of blocks runs the arms in a fresh (seeded) order. A fixed order of 4 arms × 7 steps shares a factor
# of 4 with a request's 16-step life (its prompt step and 15 decodes), so one arm saw half the prompt steps of
# the others and its mean step looked 11 % shorter; shuffled cycles give every arm every phase.


class TimedEngine(Engine):
    """Keeps how long each step's observer work took (digest and calls), with the step's interval."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.notify_us: list[float] = []

    def _notify(self, report) -> None:
        t0 = time.perf_counter_ns()
        super()._notify(report)
        self.notify_us.append((time.perf_counter_ns() - t0) / 1000)


class Pickled:
    """What the engine process does with a digest for the server-side meter: it pickles it into a message."""

    def __init__(self) -> None:
        self.num_bytes = 0

    def on_step(self, digest) -> None:
        self.num_bytes += len(pickle.dumps(digest.to_wire(), pickle.HIGHEST_PROTOCOL))

    def on_idle(self, now_ns: int, **kwargs) -> None:
        pass


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
    engine = TimedEngine(executor, checkpoint.tokenizer, checkpoint.eos_token_ids, clock=clock.now_ns)
    info = executor.info
    device = Device(info.kind, info.device_id, info.unit, info.num_compute_units)
    with tempfile.TemporaryDirectory() as tmp:
        outbox = Outbox(Path(tmp) / "outbox.db")
        meter = Meter(device, "bench", clock.epoch_us, outbox.append, started_ns=clock.now_ns())
        # blocks of steps take turns (records of calls that end outside the meter's blocks are not made:
        # the bench times the meter, it bills nobody)
        arms = {"meter-thread": [meter], "meter-process": [Pickled()], "null": [Null()], "none": []}
        steps_us: dict[str, list[float]] = {arm: [] for arm in arms}
        observer_us: dict[str, list[float]] = {arm: [] for arm in arms}
        n, t_end = 0, time.monotonic() + 900
        rng, order, last_block = random.Random(0), list(arms), -1
        while sum(map(len, steps_us.values())) < len(arms) * args.steps and time.monotonic() < t_end:
            block = sum(map(len, steps_us.values())) // BLOCK_STEPS
            if block % len(arms) == 0 and block != last_block:
                order = rng.sample(list(arms), len(arms))
            last_block = block
            arm = order[block % len(arms)]
            engine.observers[:] = arms[arm]
            while engine.scheduler.num_unfinished + len(engine._inbox) < args.batch:
                rid = f"r{n}"
                context = RecordContext("bench", {"team": "bench"}, checkpoint.name, clock.now_epoch_us(),
                                        clock.now_epoch_us(), clock.now_epoch_us() + 10**9)
                meter.register(rid, context)
                engine.add_request(Request(rid, (1, 2, 3, 4, 5, 6, 7, 8), SamplingParams(
                    max_tokens=16, temperature=0.0, ignore_eos=True), clock.now_ns()), Discard())
                n += 1
            engine.notify_us.clear()
            report = engine.step()
            if report is not None:
                steps_us[arm].append(report.interval_ns / 1000)
                observer_us[arm].append(sum(engine.notify_us))
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
        "observer_time": {arm: pct(observer_us[arm], steps_us[arm]) for arm in arms},
        "digest_bytes_per_step": round(arms["meter-process"][0].num_bytes / max(len(steps_us["meter-process"]), 1)),
        "final_outbox_flush_ms": round(flush_ms, 2)}, indent=2))


if __name__ == "__main__":
    main()
