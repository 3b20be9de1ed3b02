"""The device watchdog on its own, on a fake clock: slow and back, a hung operation, recovery; the watched executor;
and faults injected on purpose."""

from __future__ import annotations

import threading

import pytest

from services.inference.cost.model import CostModel
from services.inference.device.spec import InjectedDeviceFault, is_device_fault
from services.inference.health.faults import Fault, FaultKind, FaultyExecutor
from services.inference.health.state import DeviceState
from services.inference.health.watchdog import Watchdog, WatchdogConfig, WatchedExecutor

MS = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def watchdog(**config) -> tuple[Watchdog, Clock, list]:
    clock, verdicts = Clock(), []
    dog = Watchdog(WatchdogConfig(**config), lambda *verdict: verdicts.append(verdict), clock)
    return dog, clock, verdicts


def timed(dog: Watchdog, measured_us: float, expected_us: float = 1000.0) -> None:
    dog.begin(expected_us)
    dog.end(measured_us, expected_us)


def test_steps_slower_than_calibrated_for_a_window_make_it_slow_then_healthy_again():
    dog, _, verdicts = watchdog(window=4, confirmations=1)
    for _ in range(3):
        timed(dog, 4000)
    assert dog.state is DeviceState.HEALTHY and verdicts == []  # a window is not full yet
    timed(dog, 4000)
    assert dog.state is DeviceState.SLOW and verdicts[-1][:2] == (DeviceState.SLOW, 4.0)
    timed(dog, 1000)
    timed(dog, 1000)
    assert dog.state is DeviceState.SLOW  # the median is still slow
    timed(dog, 1000)
    timed(dog, 1000)
    assert dog.state is DeviceState.HEALTHY and [v[0] for v in verdicts] == [DeviceState.SLOW, DeviceState.HEALTHY]


def test_one_stalled_step_in_a_window_is_not_a_slow_device():
    dog, _, verdicts = watchdog(window=8)
    for i in range(20):
        timed(dog, 50_000 if i % 8 == 0 else 1000)
    assert dog.state is DeviceState.HEALTHY and verdicts == []


def test_a_state_changes_only_when_two_medians_in_a_row_agree():
    dog, _, verdicts = watchdog(window=4, confirmations=2)  # a median every 2 steps, over the last 4
    for _ in range(4):
        timed(dog, 4000)
    assert dog.state is DeviceState.HEALTHY  # one slow median
    for _ in range(2):
        timed(dog, 1000)  # the next median, over 4000, 4000, 1000, 1000: 2.5, slow again
    assert dog.state is DeviceState.SLOW

    # medians over half-overlapping windows that lean slow, then healthy, then neither, over and over
    cycle = [3000] * 4 + [3000, 3000, 0, 0] + [0] * 4
    for confirmations, flaps in ((2, False), (1, True)):
        dog, _, verdicts = watchdog(window=8, confirmations=confirmations)
        for measured in cycle * 5:
            timed(dog, measured)
        assert bool(verdicts) is flaps, verdicts


def test_an_operation_late_for_three_ticks_fails_the_device_and_its_end_brings_it_back():
    dog, clock, verdicts = watchdog(min_allowance_s=0.05, late_factor=8, failures=3)
    dog.begin(1000)  # allowed max(8 ms, 50 ms)
    for now_ms in (10, 40, 60, 70):
        clock.ns = now_ms * MS
        dog.check()
    assert dog.state is DeviceState.HEALTHY  # late at 60 and 70 ms: two ticks
    clock.ns = 80 * MS
    dog.check()
    assert dog.state is DeviceState.FAILED and verdicts[-1][:2] == (DeviceState.FAILED, 0.0)
    dog.check()
    assert len(verdicts) == 1  # said once
    dog.end(5_000_000, 1000)  # it ran 5 s, then the device answered again
    timed(dog, 1000)
    assert dog.state is DeviceState.FAILED  # two answers: not yet back
    timed(dog, 1000)
    assert dog.state is DeviceState.HEALTHY
    assert [v[0] for v in verdicts] == [DeviceState.FAILED, DeviceState.HEALTHY]


def test_a_late_tick_then_a_timely_one_starts_the_count_again():
    dog, clock, _ = watchdog(min_allowance_s=0.05, failures=2)
    dog.begin(1000)
    clock.ns = 60 * MS
    dog.check()
    dog.end(60_000, 1000)
    dog.begin(1000)
    clock.ns = 200 * MS
    dog.check()  # late again, but only once in a row
    assert dog.state is DeviceState.HEALTHY


def test_the_judge_thread_fails_a_hung_operation_on_its_own():
    failed = threading.Event()
    dog = Watchdog(WatchdogConfig(period_s=0.01, min_allowance_s=0.02), lambda state, *_: failed.set())
    dog.start()
    try:
        dog.begin(10)
        assert failed.wait(5) and dog.state is DeviceState.FAILED
    finally:
        dog.stop()


class Device:
    """A fake executor: each operation takes `op_s` on the watchdog's fake clock (the one that times it)."""

    def __init__(self, clock=None, op_s: float = 0.0) -> None:
        self.clock, self.op_s, self.runs, self.probes = clock, op_s, 0, 0

    def run(self, step):
        self.runs += 1
        self._take()
        return step

    def probe(self) -> None:
        self.probes += 1
        self._take()

    def _take(self) -> None:
        if self.clock is not None:
            self.clock.ns += int(self.op_s * 1e9)


class Step:
    num_tokens, context_tokens = 8, 100


def test_the_watched_executor_judges_speed_by_steps_and_hangs_by_probes_too():
    dog, clock, _ = watchdog(window=1, confirmations=1, slow_ratio=1.5, min_allowance_s=0.05)
    cost = CostModel([1, 8], [500.0, 2000.0], 10.0)  # 8 rows, 100 context: 3000 µs
    device = Device(clock, op_s=0.02)
    watched = WatchedExecutor(device, dog, cost, probe_us=1)
    step = Step()
    assert watched.run(step) is step and dog.state is DeviceState.SLOW  # 20 ms against 3
    watched.probe()  # 20 ms against 1 µs: a probe does not judge speed
    assert dog.state is DeviceState.SLOW and device.probes == 1

    def hung_probe() -> None:
        clock.ns += 10**9  # it runs for a second, on the watchdog's clock
        for _ in range(3):
            dog.check()

    device.probe = hung_probe
    watched.probe()
    assert dog.state is DeviceState.FAILED


def test_a_failing_operation_still_ends_its_timing():
    dog, _, _ = watchdog()

    class Broken(Device):
        def run(self, step):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        WatchedExecutor(Broken(), dog, CostModel([1], [100.0], 0.0), 100).run(Step())
    assert dog._op is None  # noqa: SLF001 - nothing is left running for the judge to find


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("slow:4,after=10,for=20", Fault(FaultKind.SLOW, 4.0, 10.0, 20.0)),
        ("hang,after=5s,for=3", Fault(FaultKind.HANG, 1.0, 5.0, 3.0)),
        ("fail", Fault(FaultKind.FAIL)),
        ("slow:2.5", Fault(FaultKind.SLOW, 2.5)),
    ],
)
def test_faults_parse(text, fault):
    assert Fault.parse(text) == fault


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("melt", "fault kind 'melt'"),
        ("slow", "a factor goes with slow"),
        ("hang:2", "a factor goes with slow"),
        ("slow:0.5", "at least 1"),
        ("slow:nan", "finite number"),
        ("hang,after=-1", "at least 0"),
        ("hang,for=inf", "finite number"),
        ("hang,every=3", "fault option 'every'"),
        ("slow:x", "factor 'x' is not a number"),
    ],
)
def test_bad_faults_are_refused_by_name(text, says):
    with pytest.raises(ValueError, match=says):
        Fault.parse(text)


class Host:
    """A fake monotonic clock in seconds, with the sleeps asked of it; its device's operations take `op_s`."""

    def __init__(self, op_s: float) -> None:
        self.now, self.op_s, self.slept = 0.0, op_s, []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        self.now += seconds

    def run(self, step):
        self.now += self.op_s
        return step

    def probe(self) -> None:
        self.now += self.op_s


def faulty(fault: Fault, op_s: float = 0.005) -> tuple[FaultyExecutor, Host]:
    host = Host(op_s)
    return FaultyExecutor(host, fault, host.clock, host.sleep), host


def test_an_injected_slowdown_applies_in_its_window_only():
    executor, host = faulty(Fault(FaultKind.SLOW, 3.0, after_s=1.0, for_s=1.0))
    executor.arm()
    executor.run(Step())
    assert host.slept == []  # before the window: no fault
    host.now = 1.5
    executor.run(Step())
    executor.probe()
    assert host.slept == [0.01, 0.01]  # in it: each 5-ms operation takes 15
    host.now = 2.5
    executor.run(Step())
    assert len(host.slept) == 2  # after it


def test_an_injected_fault_is_a_device_fault_and_waits_for_arming():
    executor, _ = faulty(Fault(FaultKind.FAIL))
    assert executor.run(Step())  # not armed: calibration runs clean
    executor.arm()
    with pytest.raises(InjectedDeviceFault) as raised:
        executor.run(Step())
    assert is_device_fault(raised.value)


def test_an_injected_hang_holds_the_operation_until_it_ends():
    executor, host = faulty(Fault(FaultKind.HANG, after_s=1.0, for_s=0.12))
    executor.arm()
    host.now = 1.0
    executor.probe()
    assert host.slept == [0.05, 0.05, 0.02] and host.now == pytest.approx(1.125)
