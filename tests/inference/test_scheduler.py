"""The scheduler on its own, with fake model outputs (no torch, no model)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.inference.sched.request import Request, RequestStatus, SamplingParams
from services.inference.sched.scheduler import Scheduler, SchedulerConfig


def make(num_slots=4, max_seq_len=64, budget=16):
    return Scheduler(SchedulerConfig(num_slots, max_seq_len, budget))


def req(rid, n_prompt, max_tokens=4, deadline_ns=None, stop=frozenset()):
    return Request(
        rid,
        tuple(range(1, n_prompt + 1)),
        SamplingParams(max_tokens=max_tokens, stop_token_ids=stop),
        arrival_ns=0,
        deadline_ns=deadline_ns,
    )


def fake_step(scheduler, now_ns=0, token=7):
    out = scheduler.schedule(now_ns)
    sampled = {s.request.call_id: token for s in (*out.decodes, *out.prefills) if s.sample}
    return out, scheduler.update_from_output(out, sampled)


def test_scheduler_does_not_import_torch():
    code = "import sys, services.inference.sched.scheduler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


TORCH_FREE_ROOMS = {
    "admission": ("services.inference.admission", "services.inference.admission.fifo"),
    "cost": ("services.inference.cost", "services.inference.cost.model"),
    "sched": (
        "services.inference.sched",
        "services.inference.sched.request",
        "services.inference.sched.scheduler",
        "services.inference.sched.blocks",
    ),
    # the engine at import: the child imports torch only when it builds the executor
    "engine": (
        "services.inference.engine",
        "services.inference.engine.engine",
        "services.inference.engine.core",
        "services.inference.engine.client",
        "services.inference.engine.messages",
        "services.inference.engine.calibration",
        "services.inference.engine.pacing",
        "services.inference.device.spec",
    ),
    "service": ("services.inference.service",),
    # the server process: it serves from the checkpoint's header and leaves the weights to the engine process
    "server": (
        "services.inference.replica",
        "services.inference.servicer",
        "services.inference.device.checkpoint",
        "services.inference.device.telemetry",
    ),
}


@pytest.mark.parametrize("room", sorted(TORCH_FREE_ROOMS))
def test_rooms_without_torch_do_not_import_it(room):
    modules = TORCH_FREE_ROOMS[room]
    code = f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"{room} imports torch"


def test_new_request_joins_the_next_step_and_decodes_after_its_prompt():
    s = make()
    s.add_request(req("a", 5))
    out, updates = fake_step(s)
    assert [p.request.call_id for p in out.prefills] == ["a"] and out.prefills[0].num_tokens == 5
    assert updates[0].new_token_id == 7
    out, _ = fake_step(s)
    assert [d.request.call_id for d in out.decodes] == ["a"] and out.decodes[0].start_pos == 5


def test_prompt_is_chunked_under_the_token_budget_and_decodes_come_first():
    s = make(budget=8)
    s.add_request(req("running", 2, max_tokens=20))
    fake_step(s)
    s.add_request(req("long", 30))
    chunks = []
    while s.requests["long"].is_prefilling:
        out, _ = fake_step(s)
        assert [d.request.call_id for d in out.decodes] == ["running"]
        assert out.num_tokens <= 8
        chunks.append(out.prefills[0].num_tokens)
    assert sum(chunks) == 30 and max(chunks) == 7


def test_requests_beyond_the_slots_wait_and_take_freed_slots():
    s = make(num_slots=2, budget=32)
    for rid in "abc":
        s.add_request(req(rid, 3, max_tokens=2))
    out, _ = fake_step(s)
    assert {p.request.call_id for p in out.prefills} == {"a", "b"} and s.num_free_slots == 0
    fake_step(s)  # a and b produce their second token and finish
    assert s.num_free_slots == 2
    out, _ = fake_step(s)
    assert [p.request.call_id for p in out.prefills] == ["c"]


@pytest.mark.parametrize("by_deadline", [True, False])
def test_waiting_requests_start_by_deadline_with_earliest_deadline_first_else_in_arrival_order(by_deadline):
    """Deadline admission's engine: a call held for a later start that finds its slot late goes ahead of calls
    admitted after it (their deadlines are later); ties, and requests with no deadline (last), in arrival order."""
    s = Scheduler(SchedulerConfig(1, 64, 32, earliest_deadline_first=by_deadline))
    s.add_request(req("running", 3, max_tokens=2))
    fake_step(s)
    for rid, deadline_ns in (("late", 900), ("none", None), ("early", 500), ("tie", 900), ("first", 100)):
        s.add_request(req(rid, 3, max_tokens=1, deadline_ns=deadline_ns))
    started = []
    for _ in range(6):
        out, _ = fake_step(s)
        started += [p.request.call_id for p in out.prefills]
    expected = ["first", "early", "late", "tie", "none"] if by_deadline else ["late", "none", "early", "tie", "first"]
    assert started == expected


def test_stop_token_and_max_tokens_finish_and_free():
    s = make()
    s.add_request(req("stop", 3, max_tokens=10, stop=frozenset({7})))
    s.add_request(req("len", 3, max_tokens=1))
    _, updates = fake_step(s)
    statuses = {u.request.call_id: u.request.status for u in updates}
    assert statuses == {"stop": RequestStatus.FINISHED_STOPPED, "len": RequestStatus.FINISHED_LENGTH}
    assert s.num_free_slots == 4 and s.num_unfinished == 0


def test_expired_requests_end_before_the_step_and_free_their_slot():
    s = make()
    s.add_request(req("late", 3, max_tokens=10, deadline_ns=1_000))
    s.add_request(req("ok", 3, max_tokens=10, deadline_ns=10**9))
    fake_step(s, now_ns=0)
    out = s.schedule(now_ns=900, expiry_guard_ns=200)
    assert [r.call_id for r in out.expired] == ["late"]
    assert out.expired[0].status == RequestStatus.FINISHED_EXPIRED
    assert [d.request.call_id for d in out.decodes] == ["ok"] and s.num_free_slots == 3


def test_next_step_size_is_the_step_that_follows_when_nothing_waits_for_a_slot():
    s = make(num_slots=4, budget=16)
    s.add_request(req("long", 20, max_tokens=10))  # 16 of its prompt now, 4 next step
    s.add_request(req("short", 3, max_tokens=10))
    assert s.next_step_size() == (16, 0)  # 23 prompt tokens wait: the budget takes 16
    fake_step(s)
    s.add_request(req("new", 5, max_tokens=10))
    size = s.next_step_size()
    out, _ = fake_step(s)
    assert size == (out.num_tokens, out.context_tokens) == (4 + 3 + 5, 0)
    size = s.next_step_size()  # three decodes: context 20 + 3 + 5 positions, and each its own new token
    out, _ = fake_step(s)
    assert size == (out.num_tokens, out.context_tokens) == (3, 28 + 3)


def test_cancel_of_a_waiting_request_removes_it():
    s = make(num_slots=1)
    s.add_request(req("a", 3, max_tokens=5))
    s.add_request(req("b", 3))
    fake_step(s)
    assert [r.call_id for r in s.finish_requests(["b", "unknown"], RequestStatus.FINISHED_CANCELLED)] == ["b"]
    assert s.num_unfinished == 1 and not s.waiting


def test_add_request_refuses_duplicates_and_oversize():
    s = make(max_seq_len=10)
    s.add_request(req("a", 3))
    with pytest.raises(ValueError, match="already"):
        s.add_request(req("a", 3))
    with pytest.raises(ValueError, match="more than 10"):
        s.add_request(req("b", 8, max_tokens=3))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 6), st.sampled_from(["run", "cancel"])), min_size=1, max_size=25
    ),
    st.integers(4, 24),
)
def test_every_request_ends_and_slots_are_conserved(plan, budget):
    s = make(num_slots=3, max_seq_len=64, budget=budget)
    for i, (n_prompt, max_tokens, fate) in enumerate(plan):
        s.add_request(req(f"r{i}", n_prompt, max_tokens))
        rows, context_tokens = s.next_step_size()
        out, _ = fake_step(s)
        assert out.num_tokens <= min(rows, budget) and out.context_tokens == context_tokens  # a bound for expiry
        if fate == "cancel":
            s.finish_requests([f"r{i}"], RequestStatus.FINISHED_CANCELLED)
        assert s.num_free_slots + len(s.running) == 3
        assert len({r.slot for r in s.running}) == len(s.running)
    for _ in range(500):
        if not s.num_unfinished:
            break
        fake_step(s)
    assert s.num_unfinished == 0 and s.num_free_slots == 3
