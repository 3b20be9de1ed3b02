"""The device watchdog: judges the device from its own timings, in the process that runs it. No torch here.

Every device operation is timed: each step against the cost model's calibrated time for its rows and context,
and, while the engine idles, a small probe every period. Two ways to go wrong:
- *slow*: the median of the last `window` steps is more than `slow_ratio` times their calibrated time (a
  throttled GPU, a noisy neighbour); back to *healthy* once that median is under `healthy_ratio`. The median is
  taken every half window, and `confirmations` of them in a row change the state: a busy shared host pushes one
  median over now and then, and a slow verdict moves admission. Probes do not judge speed: an op of tens of µs is
  all jitter there;
- *failed*: an operation, step or probe, still running past its allowance (`late_factor` × its calibrated time,
  at least `min_allowance_s`) at `failures` judge ticks in a row: a hung kernel, a lost device. A judge thread
  ticks every period, since the thread that runs the device is the one stuck. After `failures` operations
  complete again, the device is back: healthy, until its steps say otherwise.
Each change is handed to `on_change(state, ratio, why)` from whichever thread saw it; `ratio` is the steps'
median time over calibrated (0 when failed).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from ..cost.model import CostModel
from .faults import ExecutorLayer
from .state import DeviceState

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WatchdogConfig:
    period_s: float = 0.1  # probe cadence when idle, and the judge's tick
    window: int = 16  # steps the state is judged on (their median, taken every half window)
    confirmations: int = 2  # medians in a row that must agree before the state changes
    slow_ratio: float = 1.5
    healthy_ratio: float = 1.25
    late_factor: float = 8.0
    min_allowance_s: float = 1.0  # short stalls of a shared host are not a failed device
    failures: int = 3  # judge ticks in a row that find an operation late: failed


class Watchdog:
    def __init__(
        self,
        config: WatchdogConfig,
        on_change: Callable[[DeviceState, float, str], None],
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.config = config
        self.on_change = on_change
        self.clock = clock
        self.state = DeviceState.HEALTHY
        self._ratios: deque[float] = deque(maxlen=config.window)
        self._num_unjudged = 0  # steps timed since the last verdict on speed
        self._leaning: tuple[DeviceState, int] = (DeviceState.HEALTHY, 0)  # where the medians point, how often
        # (started_ns, expected_us) of the operation running now: set and cleared by the device's thread alone, read
        # by the judge (one reference, so no lock: this is on every step's path)
        self._op: tuple[int, float] | None = None
        self._late: tuple[tuple[int, float] | None, int] = (None, 0)  # the operation found late, and how often
        self._answered = 0  # operations completed since the device failed
        self._lock = threading.Lock()  # state changes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the thread that runs the device ----
    def begin(self, expected_us: float) -> int:
        """An operation expected to take `expected_us` (calibrated) starts now; returns now, on the watchdog's
        clock, which also times the operation (one clock read fewer on every step's path)."""
        started_ns = self.clock()
        self._op = (started_ns, expected_us)
        return started_ns

    def end(self, measured_us: float, expected_us: float, judges_speed: bool = True) -> None:
        """The operation begun last took `measured_us`; a step judges the device's speed, a probe does not. A
        verdict on speed is reached every half window of steps, not on every one."""
        self._op = None
        if self.state is DeviceState.FAILED:
            self._answered += 1
            if self._answered >= self.config.failures:
                self._change(DeviceState.HEALTHY, 1.0, f"{self._answered} device operations completed again")
            return
        if not judges_speed:
            return
        self._ratios.append(measured_us / max(expected_us, 1e-3))
        self._num_unjudged += 1
        if self._num_unjudged < max(self.config.window // 2, 1) or len(self._ratios) < self.config.window:
            return
        self._num_unjudged = 0
        median = statistics.median(self._ratios)
        if median > self.config.slow_ratio:
            new = DeviceState.SLOW
        elif median < self.config.healthy_ratio:
            new = DeviceState.HEALTHY
        else:
            return
        leaning, times = self._leaning
        self._leaning = (new, times + 1 if leaning is new else 1)
        if new is not self.state and self._leaning[1] >= self.config.confirmations:
            why = f"the median of the last {len(self._ratios)} steps took {median:.2f}x calibrated"
            self._change(new, median, why)

    # ---- the judge ----
    def check(self) -> None:
        """One judge tick: counts an operation running past its allowance; `failures` ticks in a row: failed."""
        op = self._op
        if op is None:
            return
        started_ns, expected_us = op
        allowance_ns = max(expected_us * 1000 * self.config.late_factor, self.config.min_allowance_s * 1e9)
        running_ns = self.clock() - started_ns
        if running_ns <= allowance_ns:
            return
        late_op, ticks = self._late
        self._late = (op, ticks + 1 if late_op is op else 1)
        if self._late[1] < self.config.failures or self.state is DeviceState.FAILED:
            return
        why = f"a device operation has run {running_ns / 1e6:.0f} ms (allowed {allowance_ns / 1e6:.0f} ms)"
        self._change(DeviceState.FAILED, 0.0, why)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._judge, name="zeroqueue-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _judge(self) -> None:
        while not self._stop.wait(self.config.period_s):
            self.check()

    def _change(self, new: DeviceState, ratio: float, why: str) -> None:
        with self._lock:
            if new is self.state:
                return
            self.state = new
            if new is DeviceState.FAILED:  # what comes after a failure is judged afresh
                self._ratios.clear()
                self._answered = 0
        level = {DeviceState.HEALTHY: log.info, DeviceState.SLOW: log.warning, DeviceState.FAILED: log.error}[new]
        level("device_state", state=new.value, ratio=round(ratio, 3), why=why)
        self.on_change(new, ratio, why)


class WatchedExecutor(ExecutorLayer):
    """The executor as the engine runs it once serving: every step and every probe timed by the watchdog (steps
    against the cost model's calibrated time for their rows and context; probes against their own, for hangs)."""

    def __init__(self, executor: Any, watchdog: Watchdog, cost: CostModel, probe_us: float) -> None:
        self.executor, self.watchdog, self.cost, self.probe_us = executor, watchdog, cost, probe_us

    def run(self, step):
        expected_us = self.cost.raw_step_us(step.num_tokens, step.context_tokens)
        watchdog = self.watchdog
        started_ns = watchdog.begin(expected_us)
        try:
            return self.executor.run(step)
        finally:  # a step that raised is timed too: the judge must not find it running
            watchdog.end((watchdog.clock() - started_ns) / 1000, expected_us)

    def probe(self) -> None:
        watchdog = self.watchdog
        started_ns = watchdog.begin(self.probe_us)
        try:
            self.executor.probe()
        finally:
            watchdog.end((watchdog.clock() - started_ns) / 1000, self.probe_us, judges_speed=False)


def probe_us(executor: Any, repeats: int = 21) -> float:
    """The probe's calibrated time on the idle device: the median of `repeats`, after one to warm up."""
    executor.probe()
    times = []
    for _ in range(repeats):
        started_ns = time.perf_counter_ns()
        executor.probe()
        times.append((time.perf_counter_ns() - started_ns) / 1000)
    return statistics.median(times)
