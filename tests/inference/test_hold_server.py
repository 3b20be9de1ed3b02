"""A held call on a real replica (a tiny checkpoint, a device with a known least step time): admitted at once for
the slot that frees inside its slack, started at that slot or sooner, finished in its deadline and billed once;
cancelled while held, billed once as cancelled with no device time; and without holds, refused as before."""

from __future__ import annotations

import time

import grpc
import pytest
from zeroqueue.inference.v1 import inference_pb2 as pb

from services.inference.admission import Admit
from tests.inference.test_overload import STEP_S, fill, metric, start_slow_server, wait_until
from tests.inference.test_usage import ledger_rows


@pytest.fixture(scope="module")
def server(llama_dir):
    s = start_slow_server(llama_dir, hold=True)
    yield s
    s.stop()


def test_a_call_with_room_for_a_later_start_is_admitted_for_it_and_served_in_time(server):
    held_before = server.replica.service.admission.events["held"]
    running = fill(server, max_tokens=40)  # both slots busy for ~0.8 s
    refused_before = metric(server, "zeroqueue_rejections_total", reason="overloaded")
    t0 = time.monotonic()
    messages = list(
        server.stub().Generate(pb.GenerateRequest(prompt="x = 1", max_tokens=10, temperature=0.0), timeout=5)
    )
    admission, final = messages[0].admission, messages[-1].final
    for call in running:
        call.join()
    assert metric(server, "zeroqueue_rejections_total", reason="overloaded") == refused_before
    assert server.replica.service.admission.events["held"] == held_before + 1
    # admitted at once, for a start after the dispatch: when a running call's slot is predicted to free
    assert admission.predicted_start_at_us > admission.dispatched_at_us
    assert admission.predicted_start_at_us < admission.predicted_finish_at_us <= admission.deadline_at_us
    assert final.timings.deadline_met and final.usage.completion_tokens == 10
    # it began once a slot was free: after the filling calls' first ~10 steps, and never after its planned start
    # by more than a few steps (a slot that frees late)
    first_step_us = final.timings.first_scheduled_at_us
    assert admission.dispatched_at_us + 10 * STEP_S * 1e6 <= first_step_us
    assert time.monotonic() - t0 < 5


def test_without_room_for_a_later_start_it_is_refused_at_once(server):
    running = fill(server, max_tokens=40)
    with pytest.raises(grpc.RpcError) as info:  # a run of 10 steps, but both slots are busy past its 0.4 s budget
        list(server.stub().Generate(pb.GenerateRequest(prompt="x = 1", max_tokens=10), timeout=0.4))
    for call in running:
        call.join()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_held_call_cancelled_before_its_start_is_billed_once_as_cancelled_with_no_device_time(llama_dir):
    server = start_slow_server(llama_dir, hold=True)
    try:
        running = fill(server, max_tokens=150)  # both slots busy for ~3 s
        call = server.stub().Generate(pb.GenerateRequest(prompt="y", max_tokens=20, request_id="held-1"), timeout=20)
        admission = next(call).admission
        assert admission.predicted_start_at_us > admission.dispatched_at_us
        assert server.replica.service.held  # it waits for its slot, not in the engine
        call.cancel()
        wait_until(lambda: not server.replica.service.held)
        for c in running:
            c.join()
        wait_until(lambda: not server.replica.service.in_flight)
        time.sleep(0.2)
    finally:
        server.stop()
    rows = ledger_rows(server.config.ledger_url, "SELECT request_id, outcome, unit_us FROM usage_records")
    mine = [r for r in rows if r.request_id == "held-1"]
    assert [(r.outcome, r.unit_us) for r in mine] == [("cancelled", 0)]
    assert len(rows) == len(running) + 1


def test_without_holds_the_same_call_is_refused_with_a_reserved_retry(llama_dir):
    server = start_slow_server(llama_dir, hold=False)
    try:
        running = fill(server, max_tokens=40)
        with pytest.raises(grpc.RpcError) as info:
            list(server.stub().Generate(pb.GenerateRequest(prompt="x = 1", max_tokens=10), timeout=5))
        for call in running:
            call.join()
    finally:
        server.stop()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(info.value.trailing_metadata())["grpc-retry-pushback-ms"] != "-1"


def test_a_start_planned_for_a_moment_the_decision_outlasted_is_told_as_its_dispatch(server):
    """A held call's planned start may come before admission has finished deciding (a slot that frees a moment
    after `now`, a decision that took longer): the call goes to the engine at once, and its Admission says so,
    never a start before its own dispatch (the fuzz test found one in 2,000 calls)."""
    admission = server.replica.service.admission
    decide = admission.decide

    def planned_at_the_decisions_start(new, now_ns):
        decision = decide(new, now_ns)
        return Admit(decision.predicted_finish_ns, start_ns=now_ns) if isinstance(decision, Admit) else decision

    admission.decide = planned_at_the_decisions_start
    try:
        messages = list(server.stub().Generate(pb.GenerateRequest(prompt="x = 1", max_tokens=4), timeout=5))
    finally:
        del admission.decide
    told, final = messages[0].admission, messages[-1].final
    assert told.received_at_us <= told.dispatched_at_us == told.predicted_start_at_us <= told.predicted_finish_at_us
    # served: the tiny checkpoint may sample its end token before max_tokens
    assert final.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP) and final.usage.completion_tokens
