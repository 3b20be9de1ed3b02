"""Issue 35, "is there an elsewhere?": a replica alone (the default) never tells its only caller to go elsewhere
while it can reserve its retry a slot inside the caller's budget; one with others beside it (`zeroqueue serve
--elsewhere`) invites no retry to itself once saturated, as before. Admission, the refusal the caller hears
(`errors.Overloaded`: its message, its ErrorInfo and its pushback), on a flat device and the SmolLM2-135M shape's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services import errors
from services.inference.admission import AdmissionSettings, Admit, RefusalCause, Reject
from services.status import status_for
from tests.inference.test_admission import MS, commit, controller
from tests.inference.test_retry_hints import overloaded
from tests.inference.test_retry_invitations import overload_while_saturated, replica

ALONE = AdmissionSettings(hold_in_slack=False, elsewhere=False, max_reservations=1)  # `zeroqueue serve`
WITH_OTHERS = AdmissionSettings(hold_in_slack=False, elsewhere=True, max_reservations=1)  # `serve --elsewhere`


def saturate(c, tenant: str = "") -> None:
    """`tenant` has been refused most of the time lately: a hundred first attempts' worth, all refused."""
    s = c.promises.saturation(tenant)
    s.refused = s.weight = 100.0
    s.saturated, s.last_ns = True, 0


def saturated_replica(settings: AdmissionSettings):
    """One slot, taken for 100 ms; its tenant ("") has been refused most of the time lately."""
    c = controller(slots=1, settings=settings)
    assert isinstance(c.decide(commit("a", max_tokens=10), 0), Admit)
    saturate(c)
    return c


def test_alone_and_saturated_a_refusal_reserves_and_invites_the_retry_while_reservations_are_free():
    c = saturated_replica(ALONE)
    first = c.decide(commit("b", max_tokens=10), 0)
    assert isinstance(first, Reject) and first.reason == RefusalCause.SLOTS_FULL and first.retry_after_ms == 100
    assert first.reserved and first.within_budget and not first.saturated and not first.elsewhere
    assert c.num_reserved == 1 and c.events["reserved"] == 1
    # the one reservation is taken: no slot can be promised, so no retry is invited, and no other replica named
    second = c.decide(commit("c", max_tokens=10), 0)
    assert isinstance(second, Reject) and second.saturated and not second.within_budget and not second.reserved
    assert not second.elsewhere and c.events["saturated"] == 1
    # the promise is kept: the retry comes at its hint and is admitted
    c.release("a")
    assert isinstance(c.decide(commit("b", max_tokens=10), 100 * MS), Admit)


def test_with_others_beside_it_a_saturated_replica_invites_no_retry_even_with_reservations_free():
    c = saturated_replica(WITH_OTHERS)
    refused = c.decide(commit("b", max_tokens=10), 0)
    assert isinstance(refused, Reject) and refused.saturated and not refused.within_budget
    assert refused.elsewhere and c.num_reserved == 0 and c.events["reserved"] == 0


def test_alone_and_saturated_no_retry_is_invited_where_none_fits_the_budget():
    c = saturated_replica(ALONE)
    refused = c.decide(commit("b", max_tokens=10, deadline_ms=150), 0)  # no slot frees in time for its run
    assert isinstance(refused, Reject) and not refused.within_budget and not refused.elsewhere
    assert c.num_reserved == 0


def test_alone_and_saturated_a_call_refused_for_the_step_budget_keeps_its_turn():
    """`serve --no-hold-prompts`: a prompt that waits for the step budget is refused with a held turn (by default
    it is admitted behind those ahead when it leaves the saturated replica's runs spare: test_burst_prompts.py)."""
    c = controller(slots=8, settings=replace(ALONE, hold_for_prompts=False))  # step budget 256 tokens, 10 ms steps
    for rid in "abcd":  # four 80-token prompts not yet begun: 320 tokens
        c.commitments[rid] = commit(rid, prompt=80)
    saturate(c)
    held = c.decide(commit("e", prompt=80), 0)
    assert held == Reject(10, held.predicted_finish_ns, reason=RefusalCause.STEP_BUDGET, reserved=True)
    refused = c.decide(commit("f", prompt=80), 0)  # at most one turn held (max_reservations)
    assert isinstance(refused, Reject) and refused.saturated and not refused.within_budget
    with_others = controller(slots=8, settings=replace(WITH_OTHERS, hold_for_prompts=False))
    with_others.commitments.update(c.commitments)
    saturate(with_others)
    assert with_others.decide(commit("g", prompt=80), 0).saturated and not with_others.turns


def saturated_run(elsewhere: bool) -> tuple:
    """A sustained 4x overload, 4-s budgets (six runs or so), at most 4 reservations: the run, the controller, and
    the decisions made while the tenant was saturated."""
    controller = replica(max_reservations=4, elsewhere=elsewhere)
    tally, while_saturated = overload_while_saturated(controller, budget_ms=4000)
    return tally, controller, while_saturated


def test_alone_a_sustained_overload_still_reserves_inside_budgets_and_invites_nothing_unbacked():
    """A sustained overload of one replica alone: while the verdict stands, it invites a retry only with a slot
    reserved for it, while reservations are free, and those retries find their slots; once they are all taken it
    invites none, and names no other replica. It serves at least what a replica with others beside it does."""
    tally, controller, while_saturated = saturated_run(elsewhere=False)
    refusals = [d for d in while_saturated if isinstance(d, Reject)]
    assert len(refusals) > 300 and not any(d.elsewhere for d in refusals)
    assert all(d.reserved for d in refusals if d.within_budget), "an invitation is a promise while saturated"
    assert sum(d.reserved for d in refusals) > 20, "reservations free: the retry is invited, backed"
    assert sum(d.saturated and not d.within_budget for d in refusals) > 100, "all taken: no retry invited"
    assert controller.events["taken"] > 20 and tally.misses == []
    with_others, _, _ = saturated_run(elsewhere=True)
    assert tally.goodput(10.0) >= 0.98 * with_others.goodput(10.0)


def test_with_others_beside_it_the_same_overload_reserves_nothing_while_saturated():
    _, controller, while_saturated = saturated_run(elsewhere=True)
    refusals = [d for d in while_saturated if isinstance(d, Reject)]
    assert len(refusals) > 300 and all(d.elsewhere and not d.within_budget for d in refusals)
    assert not any(d.reserved for d in refusals)


# --- what the caller hears ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("elsewhere", [False, True])
def test_a_saturated_refusal_names_another_replica_only_where_there_is_one(elsewhere):
    err = errors.Overloaded(120, 900, 2000, cause=RefusalCause.SLOTS_FULL, saturated=True, elsewhere=elsewhere)
    assert err.metadata["elsewhere"] == str(elsewhere).lower() and err.metadata["saturated"] == "true"
    assert err.metadata["retry_within_budget"] == "false" and err.pushback_ms == -1
    assert ("try another replica" in err.message) == elsewhere
    assert ("there is no other replica to try" in err.message) == (not elsewhere)
    assert "120 ms" in err.message
    info = status_for(err).details[0]
    assert info.metadata["elsewhere"] == str(elsewhere).lower()


@pytest.mark.parametrize("elsewhere", [False, True])
def test_a_refusal_with_no_retry_inside_its_budget_names_another_replica_only_where_there_is_one(elsewhere):
    err = errors.Overloaded(1_227, 171, 580, within_budget=False, cause=RefusalCause.SLOTS_FULL, elsewhere=elsewhere)
    assert "no retry fits" in err.message and err.metadata["saturated"] == "false"
    assert ("try another replica" in err.message) == elsewhere
    assert ("there is no other replica to try" in err.message) == (not elsewhere)


def test_an_alone_replicas_backed_refusal_invites_the_retry_as_any_other():
    c = saturated_replica(ALONE)
    err = overloaded(c.decide(commit("b", max_tokens=10), 0), 0, 1000)
    assert err.metadata["elsewhere"] == "false" and err.metadata["saturated"] == "false"
    assert err.metadata["retry_reserved"] == "true" and err.pushback_ms == 100
    assert "retry in 100 ms: a slot is reserved for it from then" in err.message
    assert "replica" not in err.message
