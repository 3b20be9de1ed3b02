"""What a refusal tells its caller: the pushback rule (gRFC A6 clients sleep a positive pushback even past the
deadline), whether the hint is backed by a reservation, and a message that says what its ErrorInfo says."""

from __future__ import annotations

import pytest
from google.rpc import error_details_pb2

from services import errors
from services.inference.admission import AdmissionConfig, AdmissionController, AdmissionSettings, RefusalCause, Reject
from services.inference.cost.model import CostModel
from services.status import status_for
from tests.inference.test_admission import MS, REFUSING, commit, controller, flat_cost


def overloaded(decision: Reject, now_ns: int, budget_ms: int) -> errors.Overloaded:
    """The error service.submit raises for a Reject."""
    assert isinstance(decision, Reject)
    return errors.Overloaded(
        decision.retry_after_ms,
        (decision.predicted_finish_ns - now_ns) // MS,
        budget_ms,
        decision.within_budget,
        decision.reason,
        decision.reserved,
        decision.saturated,
        decision.elsewhere,
    )


def wire(error: errors.Overloaded) -> tuple[dict, error_details_pb2.ErrorInfo, int]:
    """Trailers, ErrorInfo and RetryInfo's delay (ms), as status_for puts them on the wire."""
    status = status_for(error)
    info, retry = (
        next(d for d in status.details if isinstance(d, cls))
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo)
    )
    return dict(status.trailing_metadata), info, retry.retry_delay.ToMilliseconds()


def assert_agrees(error: errors.Overloaded, decision: Reject) -> None:
    """The message says what the ErrorInfo and the trailers say, no more and no less."""
    trailers, info, delay_ms = wire(error)
    meta, message = info.metadata, error.message
    assert meta["cause"] == decision.reason
    assert delay_ms == int(trailers["retry-after-ms"]) == int(meta["retry_after_ms"]) == decision.retry_after_ms
    assert f"{meta['predicted_finish_ms']} ms" in message and f"{meta['budget_ms']} ms" in message
    assert ("exceeds" in message) == (decision.reason == RefusalCause.DEADLINE)
    assert message.startswith("slots full") == (decision.reason == RefusalCause.SLOTS_FULL)
    fits, reserved = meta["retry_within_budget"] == "true", meta["retry_reserved"] == "true"
    assert (trailers["grpc-retry-pushback-ms"] == "-1") == (not fits) == ("no retry fits" in message)
    assert ("best guess" in message) == (fits and not reserved)
    assert ("reserved for it" in message or "turn is held" in message) == reserved
    assert ("turn is held" in message) == (reserved and decision.reason == RefusalCause.STEP_BUDGET)


# --- the pushback rule ---------------------------------------------------------------------------------------


def test_a_hint_that_fits_the_remaining_time_is_the_pushback():
    trailers, info, delay_ms = wire(errors.Overloaded(300, 120, 2_000, True, RefusalCause.SLOTS_FULL, reserved=True))
    assert trailers["grpc-retry-pushback-ms"] == trailers["retry-after-ms"] == "300" and delay_ms == 300
    assert info.metadata["retry_within_budget"] == info.metadata["retry_reserved"] == "true"


def test_a_hint_past_the_deadline_says_do_not_retry_and_still_carries_the_hint():
    trailers, info, delay_ms = wire(
        errors.Overloaded(1_227, 171, 580, within_budget=False, cause=RefusalCause.SLOTS_FULL)
    )
    assert trailers["grpc-retry-pushback-ms"] == "-1"
    # for the SDK and failover: when this replica frees up
    assert trailers["retry-after-ms"] == "1227" and delay_ms == 1_227
    assert info.metadata["retry_within_budget"] == info.metadata["retry_reserved"] == "false"


@pytest.mark.parametrize("hint_ms, budget_ms", [(2_000, 2_000), (2_500, 2_000)])
def test_a_hint_at_or_past_the_remaining_time_is_minus_one_whatever_admission_said(hint_ms, budget_ms):
    error = errors.Overloaded(
        hint_ms, 100, budget_ms, within_budget=True, cause=RefusalCause.STEP_BUDGET, reserved=True
    )
    trailers, info, _ = wire(error)
    assert error.pushback_ms == -1 and trailers["grpc-retry-pushback-ms"] == "-1"
    assert info.metadata["retry_within_budget"] == info.metadata["retry_reserved"] == "false"


def test_an_unbacked_hint_that_fits_is_still_a_positive_pushback_and_says_it_is_a_guess():
    error = errors.Overloaded(1_391, 170, 9_000, True, RefusalCause.SLOTS_FULL, reserved=False)
    trailers, info, _ = wire(error)
    assert trailers["grpc-retry-pushback-ms"] == "1391"
    assert info.metadata["retry_reserved"] == "false" and "best guess" in error.message


def test_an_infeasible_budget_still_says_do_not_retry():
    trailers = dict(status_for(errors.DeadlineInfeasible(50, 210)).trailing_metadata)
    assert trailers["grpc-retry-pushback-ms"] == "-1"


# --- backed and unbacked hints, from admission -----------------------------------------------------------------


def test_at_most_one_reservation_per_slot_then_the_hint_says_it_is_a_best_guess():
    c = controller(slots=2)
    c.decide(commit("a", max_tokens=5), 0)
    c.decide(commit("b", max_tokens=20), 0)
    refused = [c.decide(commit(rid, max_tokens=5), 0) for rid in ("c", "d", "e")]
    assert [r.reserved for r in refused] == [True, True, False] and c.num_reserved == 2
    assert all(r.within_budget and r.reason == RefusalCause.SLOTS_FULL for r in refused)
    for r in refused:
        assert_agrees(overloaded(r, 0, 1_000), r)
    assert overloaded(refused[2], 0, 1_000).pushback_ms == refused[2].retry_after_ms > 0


def test_a_refusal_for_the_step_budget_holds_its_turn_while_turns_last():
    c = AdmissionController(
        flat_cost(),
        AdmissionConfig(8, 256, margin_ms=0, margin_fraction=0),
        AdmissionSettings(max_reservations=1, hold_in_slack=False, hold_for_prompts=False),  # `--no-hold-prompts`
    )
    for rid in "abcd":  # four 80-token prompts not yet begun: the next step cannot take a fifth
        c.decide(commit(rid, prompt=80), 0)
    first, second = (c.decide(commit(rid, prompt=80), 0) for rid in "ef")
    assert (first.reason, first.reserved) == (RefusalCause.STEP_BUDGET, True) and set(c.turns) == {"e"}
    assert (second.reason, second.reserved) == (RefusalCause.STEP_BUDGET, False)
    for r in (first, second):
        assert_agrees(overloaded(r, 0, 1_000), r)


# --- why not now: the reason, and a message that agrees with the ErrorInfo ---------------------------------------


def test_slots_full_is_not_reported_as_a_deadline_miss():
    c = controller(slots=1)
    c.decide(commit("a", max_tokens=5), 0)
    refused = c.decide(commit("b", max_tokens=5, deadline_ms=3_000), 0)
    assert refused.reason == RefusalCause.SLOTS_FULL
    error = overloaded(refused, 0, 3_000)
    assert int(error.metadata["predicted_finish_ms"]) < 3_000 and "exceeds" not in error.message
    assert_agrees(error, refused)


def test_its_own_late_finish_is_a_deadline_refusal():
    slow = CostModel(rows=[1, 2], row_us=[10_000, 30_000], us_per_context_token=0.0, num_deviations=0, deviation=0)
    # its retry (at 100 ms, done by 200) would leave less spare than its run: not the point here
    no_slack = AdmissionSettings(retry_slack_runs=0.0, hold_in_slack=False)
    c = AdmissionController(slow, AdmissionConfig(4, 256, margin_ms=0, margin_fraction=0), no_slack)
    c.decide(commit("a", prompt=1, max_tokens=10, deadline_ms=10_000), 0)
    refused = c.decide(commit("b", prompt=1, max_tokens=10, deadline_ms=250), 0)  # ~320 ms at batch 2
    assert refused.reason == RefusalCause.DEADLINE and refused.within_budget
    error = overloaded(refused, 0, 250)
    assert int(error.metadata["predicted_finish_ms"]) > 250
    assert_agrees(error, refused)


def test_pushing_an_admitted_call_late_is_its_own_reason():
    slow = CostModel(rows=[1, 2], row_us=[10_000, 30_000], us_per_context_token=0.0, num_deviations=0, deviation=0)
    c = AdmissionController(slow, AdmissionConfig(4, 256, margin_ms=0, margin_fraction=0), REFUSING)
    c.decide(commit("tight", prompt=1, max_tokens=10, deadline_ms=150), 0)
    refused = c.decide(commit("late", prompt=1, max_tokens=10, deadline_ms=10_000), 0)
    assert refused.reason == RefusalCause.DELAYS_ADMITTED
    error = overloaded(refused, 0, 10_000)
    assert int(error.metadata["predicted_finish_ms"]) <= 10_000 and "admitted call" in error.message
    assert_agrees(error, refused)


@pytest.mark.parametrize("elsewhere", [False, True])
def test_no_room_inside_the_budget_keeps_its_reason_and_names_another_replica_only_where_there_is_one(elsewhere):
    c = controller(slots=1, step_ms=1.0, settings=AdmissionSettings(hold_in_slack=False, elsewhere=elsewhere))
    c.decide(commit("long", max_tokens=500, deadline_ms=10_000), 0)
    refused = c.decide(commit("short", max_tokens=10, deadline_ms=100), 0)
    assert not refused.within_budget and not refused.reserved and refused.reason == RefusalCause.SLOTS_FULL
    error = overloaded(refused, 0, 100)
    assert error.pushback_ms == -1 and error.metadata["elsewhere"] == str(elsewhere).lower()
    assert ("try another replica" in error.message) == elsewhere
    assert ("there is no other replica to try" in error.message) == (not elsewhere)
    assert_agrees(error, refused)


@pytest.mark.parametrize("cause", ["over_share", "priority"])
def test_a_refusal_for_kept_headroom_says_that_headroom_is_never_reserved(cause: str):
    """Kept headroom is for other tenants or higher classes: the message must not blame taken reservations."""
    error = errors.Overloaded(retry_after_ms=40, predicted_finish_ms=300, budget_ms=1_000, cause=cause)
    assert "best guess" in error.message and "kept headroom is never reserved" in error.message
    assert "every reservation is taken" not in error.message
    plain = errors.Overloaded(retry_after_ms=40, predicted_finish_ms=300, budget_ms=1_000, cause="slots_full")
    assert "every reservation is taken" in plain.message
