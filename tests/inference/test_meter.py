"""The meter on its own: exact splits, conservation of wall time, records and idle minutes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from billing.records import Door, RequestKind
from services.inference.device.spec import Device
from services.inference.engine.digest import StepDigest, ended_request
from services.inference.meter import US_PER_MINUTE, Meter, RecordContext, split_exact
from services.inference.sched.request import Request, RequestStatus, SamplingParams

EPOCH_US = 29_833_334 * 60_000_000  # a UTC minute boundary in 2026
DEVICE = Device("cpu", "cpu", "cpu:test", 2, "core_us")


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**12), st.lists(st.integers(0, 10**6), min_size=1, max_size=64).filter(any))
def test_split_adds_up_exactly_and_is_proportional(total, weights):
    parts = split_exact(total, weights)
    assert sum(parts) == total
    weight_sum = sum(weights)
    for part, weight in zip(parts, weights):
        assert abs(part - total * weight / weight_sum) < 1  # off by less than one unit
        assert weight or part == 0


def test_split_is_deterministic_on_ties():
    assert split_exact(10, [1, 1, 1]) == [4, 3, 3]
    assert split_exact(2, [1, 1, 1]) == [1, 1, 0]


class Recorder:
    def __init__(self):
        self.usage, self.idle = [], []

    def __call__(self, usage, idle):
        self.usage += [build() for build in usage]
        self.idle += idle


def make_meter(recorder, start_ns=0):
    return Meter(DEVICE, "m", "boot1", lambda ns: EPOCH_US + ns // 1000, recorder, started_ns=start_ns)


def req(rid, prompt=4, max_tokens=8):
    return Request(rid, tuple(range(prompt)), SamplingParams(max_tokens=max_tokens), 0, 10**15)


def report(decodes, prefills, began_ns, ended_ns, ended=(), unfinished=1):
    work = (*((r.call_id, 1) for r in decodes), *((r.call_id, n) for r, n in prefills))
    return StepDigest(began_ns, ended_ns, bool(work), work, 0, tuple(map(ended_request, ended)), unfinished, 0)


def register(meter, *requests):
    for r in requests:
        meter.register(r.call_id, RecordContext("acme", {"team": "ml"}, 0, 0, 10**12))


def test_a_step_is_split_by_tokens_and_the_record_carries_the_sum():
    rec = Recorder()
    meter = make_meter(rec)
    a, b = req("a"), req("b")
    register(meter, a, b)
    meter.on_step(report([a], [(b, 3)], 0, 4_000_000))  # 4 ms × 2 cores = 8000 core·µs, 1:3
    assert meter.usage_unit_us == {"a": 2000, "b": 6000}
    a.status = RequestStatus.FINISHED_LENGTH
    a.output_token_ids = [1, 2]
    meter.on_step(report([a, b], [], 4_000_000, 6_000_000, ended=[a]))  # back to back: 4000 more, 1:1
    (record,) = rec.usage
    assert record.call_id == "a" and record.unit_us == 4000 and record.unit == "core_us"
    assert record.outcome == "ok" and record.deadline_met and record.completion_tokens == 2
    assert meter.usage_unit_us == {"b": 8000}


def test_the_record_carries_its_calls_request_kind_and_a_call_of_no_kind_is_plain():
    rec = Recorder()
    meter = make_meter(rec)
    a, b = req("a"), req("b")
    meter.register("a", RecordContext("acme", {}, 0, 0, 10**12, request_kind=RequestKind.CHAT_CONSTRAINED))
    meter.register("b", RecordContext("acme", {}, 0, 0, 10**12))
    meter.on_step(report([a, b], [], 0, 1_000_000))
    a.status = b.status = RequestStatus.FINISHED_LENGTH
    meter.on_step(report([a, b], [], 1_000_000, 2_000_000, ended=[a, b], unfinished=0))
    assert {r.call_id: r.request_kind for r in rec.usage} == {"a": RequestKind.CHAT_CONSTRAINED, "b": RequestKind.PLAIN}
    assert {r.call_id: r.unit_us for r in rec.usage} == {"a": 2000, "b": 2000}  # the kind prices nothing


def test_the_record_carries_its_calls_door_and_a_call_of_no_door_is_grpc():
    rec = Recorder()
    meter = make_meter(rec)
    a, b = req("a"), req("b")
    meter.register("a", RecordContext("acme", {}, 0, 0, 10**12, request_kind=RequestKind.CHAT, door=Door.HTTP))
    meter.register("b", RecordContext("acme", {}, 0, 0, 10**12, request_kind=RequestKind.CHAT))
    meter.on_step(report([a, b], [], 0, 1_000_000))
    a.status = b.status = RequestStatus.FINISHED_LENGTH
    meter.on_step(report([a, b], [], 1_000_000, 2_000_000, ended=[a, b], unfinished=0))
    assert {r.call_id: r.door for r in rec.usage} == {"a": Door.HTTP, "b": Door.GRPC}
    assert {r.call_id: r.unit_us for r in rec.usage} == {"a": 2000, "b": 2000}  # the door prices nothing


def test_every_record_carries_the_replicas_weight_dtype_and_a_meter_told_none_says_unknown():
    for weight_dtype in ("int8", "bfloat16", ""):
        rec = Recorder()
        meter = Meter(DEVICE, "m", "boot1", lambda ns: EPOCH_US + ns // 1000, rec, 0, weight_dtype=weight_dtype)
        a, b = req("a"), req("b")
        register(meter, a, b)
        meter.on_step(report([a, b], [], 0, 1_000_000))
        a.status = b.status = RequestStatus.FINISHED_LENGTH
        meter.on_step(report([a, b], [], 1_000_000, 2_000_000, ended=[a, b], unfinished=0))
        assert [(r.weight_dtype, r.unit_us) for r in rec.usage] == [(weight_dtype, 2000)] * 2  # it prices nothing


def test_time_between_busy_steps_is_billed_and_time_with_no_request_is_idle():
    rec = Recorder()
    meter = make_meter(rec)
    a = req("a")
    register(meter, a)
    meter.on_step(report([a], [], 1_000_000, 2_000_000))  # 1 ms idle first, then 1 ms busy
    meter.on_step(report([a], [], 2_500_000, 3_000_000, unfinished=0))  # 0.5 ms of host work is billed
    assert meter.billed_unit_us == 2 * 2000 and meter.idle_unit_us == 2 * 1000
    meter.on_step(report([a], [], 10_000_000, 11_000_000, unfinished=0))  # nothing ran in between: idle
    assert meter.idle_unit_us == 2 * 8000
    assert meter.billed_unit_us + meter.idle_unit_us == meter.wall_unit_us


def test_idle_minutes_close_with_wall_and_idle_time():
    rec = Recorder()
    meter = make_meter(rec)
    meter.on_idle(90 * 1_000_000_000)  # 90 s idle: minute 0 closes
    (first,) = rec.idle
    assert first.minute_start_us == EPOCH_US and first.idle_unit_us == first.wall_unit_us == 2 * US_PER_MINUTE
    meter.on_idle(100 * 1_000_000_000, final=True)  # shutdown closes the partial minute
    assert rec.idle[1].wall_unit_us == 2 * 40_000_000
    assert len({r.record_id for r in rec.idle}) == 2


def test_cancelled_request_is_recorded_with_its_outcome():
    rec = Recorder()
    meter = make_meter(rec)
    a = req("a")
    register(meter, a)
    meter.on_step(report([a], [], 0, 1_000_000))
    a.status = RequestStatus.FINISHED_CANCELLED
    meter.on_step(report([], [], 1_500_000, 1_500_000, ended=[a], unfinished=0))
    (record,) = rec.usage
    assert record.outcome == "cancelled" and record.unit_us == 2000 and record.deadline_met


def test_time_after_the_last_request_is_cancelled_is_idle_not_the_next_requests():
    rec = Recorder()
    meter = make_meter(rec)
    a, b = req("a"), req("b")
    register(meter, a, b)
    meter.on_step(report([a], [], 0, 1_000_000))  # a runs, more to come
    a.status = RequestStatus.FINISHED_CANCELLED
    meter.on_step(report([], [], 1_200_000, 1_200_000, ended=[a], unfinished=0))
    meter.on_idle(5_000_000)
    meter.on_step(report([b], [], 9_000_000, 10_000_000, unfinished=0))  # b arrives 8 ms later
    assert meter.usage_unit_us["b"] == 2 * 1000  # its own 1 ms step, nothing before it
    assert meter.idle_unit_us == 2 * 8000
    assert meter.billed_unit_us + meter.idle_unit_us == meter.wall_unit_us


steps = st.lists(
    st.tuples(
        st.integers(0, 5_000_000),
        st.integers(1, 5_000_000),
        st.lists(st.integers(1, 64), min_size=1, max_size=8),
        st.booleans(),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(steps, st.integers(0, 3 * 60 * 10**9))
def test_billed_plus_idle_is_wall_time_and_every_step_splits_exactly(plan, start_ns):
    rec = Recorder()
    meter = make_meter(rec, start_ns)
    now = start_ns
    requests = {}
    for i, (gap, duration, tokens, more) in enumerate(plan):
        batch = [requests.setdefault(f"r{i}-{j}", req(f"r{i}-{j}")) for j in range(len(tokens))]
        before = dict(meter.usage_unit_us)
        billed_before = meter.billed_unit_us
        meter.on_step(
            report([], list(zip(batch, tokens)), now + gap, now + gap + duration, unfinished=1 if more else 0)
        )
        step_total = meter.billed_unit_us - billed_before
        assert sum(meter.usage_unit_us.get(r.call_id, 0) - before.get(r.call_id, 0) for r in batch) == step_total
        now += gap + duration
    meter.on_idle(now + 61 * 10**9, final=True)
    assert meter.billed_unit_us + meter.idle_unit_us == meter.wall_unit_us
    assert sum(r.wall_unit_us for r in rec.idle) == meter.wall_unit_us
    assert sum(r.idle_unit_us for r in rec.idle) == meter.idle_unit_us
    assert sum(meter.usage_unit_us.values()) == meter.billed_unit_us
