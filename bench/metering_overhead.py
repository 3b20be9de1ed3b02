"""Metering's cost to the engine step (goal: < 1 % of step time).

Runs batches of greedy requests through the engine and times, in each step, what the step does for metering,
in blocks of 7 steps that take turns among four arms (two layouts, each with its control):

  - meter-thread: the meter as `zeroqueue serve --engine-thread` attaches it, an observer called in the step
    (building the digest, splitting the step, handing records to a real outbox on disk);
  - none: the same engine with no observer (the control of meter-thread);
  - meter-process: what the engine process pays under plain `zeroqueue serve`, where the meter runs in the
    server process: the step's digest built as its wire form and pickled with the step's outputs into the one
    message per step, by the child's own relay (its pickle included; only the pipe's write is left out);
  - outputs-only: the same relay shipping the outputs alone, no digest (the control of meter-process: the
    outputs travel whether or not anything is metered).

    python bench/metering_overhead.py [--model DIR] [--batch 8] [--steps 600 per arm]

Reported: the time against its step's interval (it runs after the interval closes; the next step's interval is
billed from there), and the median and mean step interval of each arm. Metering's cost in a layout is its arm
less its control. The outbox's group commit runs on another thread: it delays a call's final message, not the
engine.
"""

from __future__ import annotations

import argparse
import json
import os
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
from services.inference.device.executor import Executor, ExecutorConfig  # noqa: E402
from services.inference.device.loader import load_checkpoint  # noqa: E402
from services.inference.engine.core import Relay  # noqa: E402
from services.inference.engine.digest import Observers  # noqa: E402
from services.inference.engine.engine import Engine  # noqa: E402
from services.inference.meter import Meter, RecordContext  # noqa: E402
from services.inference.sched.request import Request, SamplingParams  # noqa: E402
from services.logs import configure_logging  # noqa: E402
from services.metering.outbox import Outbox  # noqa: E402

DEFAULT_MODEL = ROOT / "services/inference/bundled/zq-python-tiny"
BLOCK_STEPS = 7
# Each cycle of blocks runs the arms in a fresh (seeded) order. A fixed order of 4 arms × 7 steps shares a factor
# of 4 with a request's 16-step life (its prompt step and 15 decodes), so one arm saw half the prompt steps of
# the others and its mean step looked 11 % shorter; shuffled cycles give every arm every phase.
ARMS = ("meter-thread", "none", "meter-process", "outputs-only")


class CountingConn:
    """Stands in for the child's pipe: the relay pickles each message itself; this counts the bytes."""

    def __init__(self) -> None:
        self.num_bytes = 0

    def send_bytes(self, data: bytes) -> None:
        self.num_bytes += len(data)


class TimedSink(Relay):
    """The engine's step sink. Every arm's outputs go through the relay (so every step ships them); what an arm
    pays for metering is timed: the observer call (thread arms), or the wire digest and the message's pickle
    (process arms)."""

    def __init__(self, conn) -> None:
        super().__init__(conn)
        self.local = Observers([])  # the observers on the engine's thread, set per arm
        self.arm = "none"
        self.metering_us = 0.0

    def report(self, report, num_free_slots: int) -> None:
        t0 = time.perf_counter_ns()
        if self.arm == "meter-process":
            super().report(report, num_free_slots)  # the wire digest, into the relay
        elif self.arm in ("meter-thread", "none"):
            self.local.report(report, num_free_slots)  # the observers on the engine's thread (none: no observer)
        self.metering_us += (time.perf_counter_ns() - t0) / 1000

    def flush(self) -> None:
        t0 = time.perf_counter_ns()
        super().flush()
        if self.arm in ("meter-process", "outputs-only"):
            self.metering_us += (time.perf_counter_ns() - t0) / 1000


def pct(calls: list[float], steps: list[float]) -> dict[str, float]:
    ratios = [c / s for c, s in zip(calls, steps)]
    return {
        "us_median": round(statistics.median(calls), 1),
        "us_p99": round(sorted(calls)[int(0.99 * len(calls))], 1),
        "pct_median": round(100 * statistics.median(ratios), 3),
        "pct_mean": round(100 * statistics.mean(ratios), 3),
    }


def difference(timed: dict[str, list[float]], steps: dict[str, list[float]], arm: str, control: str) -> dict:
    """An arm's cost less its control's, in µs and as a share of the arm's step (median and mean)."""
    median_us = statistics.median(timed[arm]) - statistics.median(timed[control])
    mean_us = statistics.mean(timed[arm]) - statistics.mean(timed[control])
    return {
        "us_median": round(median_us, 1),
        "us_mean": round(mean_us, 1),
        "pct_of_step_median": round(100 * median_us / statistics.median(steps[arm]), 3),
        "pct_of_step_mean": round(100 * mean_us / statistics.mean(steps[arm]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    checkpoint = load_checkpoint(args.model)
    executor = Executor(checkpoint, ExecutorConfig(max_batch=args.batch, max_seq_len=512))
    clock = Clock()
    conn = CountingConn()
    sink = TimedSink(conn)
    engine = Engine(executor, checkpoint.tokenizer, checkpoint.eos_token_ids, clock=clock.now_ns, sink=sink)
    device = executor.info
    with tempfile.TemporaryDirectory() as tmp:
        outbox = Outbox(Path(tmp) / "outbox.db")
        meter = Meter(device, checkpoint.name, "bench", clock.epoch_us, outbox.append, started_ns=clock.now_ns())
        # blocks of steps take turns (records of calls that end outside the meter's blocks are not made:
        # the bench times the meter, it bills nobody)
        observers = {"meter-thread": [meter]}
        steps_us: dict[str, list[float]] = {arm: [] for arm in ARMS}
        metering_us: dict[str, list[float]] = {arm: [] for arm in ARMS}
        message_bytes = {arm: 0 for arm in ARMS}
        n, t_end = 0, time.monotonic() + 900
        rng, order, last_block = random.Random(0), list(ARMS), -1
        while sum(map(len, steps_us.values())) < len(ARMS) * args.steps and time.monotonic() < t_end:
            block = sum(map(len, steps_us.values())) // BLOCK_STEPS
            if block % len(ARMS) == 0 and block != last_block:
                order = rng.sample(ARMS, len(ARMS))
            last_block = block
            arm = order[block % len(ARMS)]
            sink.arm, sink.local.observers[:] = arm, observers.get(arm, [])
            while engine.scheduler.num_unfinished + len(engine._inbox) < args.batch:
                rid = f"r{n}"
                now_ns = clock.now_ns()
                context = RecordContext("bench", {"team": "bench"}, now_ns, now_ns, now_ns + 10**12)
                meter.register(rid, context)
                engine.add_request(
                    Request(
                        rid,
                        (1, 2, 3, 4, 5, 6, 7, 8),
                        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                        clock.now_ns(),
                    ),
                    sink,
                )
                n += 1
            sink.metering_us, bytes_before = 0.0, conn.num_bytes
            report = engine.step()
            if report is not None:
                steps_us[arm].append(report.interval_ns / 1000)
                metering_us[arm].append(sink.metering_us)
                message_bytes[arm] += conn.num_bytes - bytes_before
        meter.on_idle(clock.now_ns(), final=True)
        t0 = time.perf_counter()
        outbox.flush()
        flush_ms = (time.perf_counter() - t0) * 1000
        counts = outbox.counts()
        outbox.close()
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "model": args.model.name,
                "batch": args.batch,
                "steps_per_arm": {arm: len(v) for arm, v in steps_us.items()},
                "records": counts,
                "step_us_median": {arm: round(statistics.median(v), 1) for arm, v in steps_us.items()},
                "step_us_mean": {arm: round(statistics.mean(v), 1) for arm, v in steps_us.items()},
                "timed": {arm: pct(metering_us[arm], steps_us[arm]) for arm in ARMS},
                "metering_cost": {
                    "thread_layout": difference(metering_us, steps_us, "meter-thread", "none"),
                    "process_layout": difference(metering_us, steps_us, "meter-process", "outputs-only"),
                },
                "message_bytes_per_step": {
                    arm: round(message_bytes[arm] / max(len(steps_us[arm]), 1))
                    for arm in ("meter-process", "outputs-only")
                },
                "final_outbox_flush_ms": round(flush_ms, 2),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    main()
