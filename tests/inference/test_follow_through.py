"""Reservations only where retries come: what admission learns, per tenant, of refused calls' return (no torch)."""

from __future__ import annotations

from services.inference.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionSettings,
    Admit,
    Commitment,
    Reject,
)
from services.inference.admission.history import FollowThrough
from tests.inference.test_admission import MS, flat_cost


def one_slot() -> AdmissionController:
    config = AdmissionConfig(1, 256, margin_ms=0, margin_fraction=0)
    return AdmissionController(flat_cost(10.0), config, AdmissionSettings(reservation_grace_ms=20, hold_in_slack=False))


def call(rid: str, tenant: str, now_ms: int, attempt: int = 0) -> Commitment:
    return Commitment(f"{tenant}/{rid}", 4, 5, (now_ms + 1000) * MS, tenant=tenant, attempt=attempt)


def refuse_and_lapse(c: AdmissionController, tenant: str, i: int, now_ms: int) -> Reject:
    """One slot busy for 50 ms from now_ms; a call of `tenant` is refused and its retry never comes."""
    assert isinstance(c.decide(call(f"busy{i}", "other", now_ms), now_ms * MS), Admit)
    refusal = c.decide(call(f"gone{i}", tenant, now_ms), now_ms * MS)
    assert isinstance(refusal, Reject) and refusal.retry_after_ms == 50
    c.release(f"other/busy{i}")
    return refusal


def test_a_tenant_whose_retries_never_come_stops_holding_slots_and_newcomers_get_them():
    c = one_slot()
    reserved = [refuse_and_lapse(c, "quitter", i, now_ms=i * 1000).reserved for i in range(10)]
    # trusted at first; each lapse lowers the share that came back (alpha 0.1): under half after 7 lapses
    assert reserved[:7] == [True] * 7 and reserved[7:9] == [False, False]
    assert c.events["lapsed"] == 7 + reserved[9] and c.events["unbacked"] == 10 - sum(reserved)
    # an unbacked refusal holds nothing: when the slot frees, the next newcomer has it
    assert isinstance(c.decide(call("busy", "other", 20_000), 20_000 * MS), Admit)
    assert not c.decide(call("gone", "quitter", 20_000), 20_000 * MS).reserved
    c.release("other/busy")
    assert isinstance(c.decide(call("newcomer", "other", 20_050), 20_050 * MS), Admit)


def test_another_tenant_keeps_its_reservations_and_they_are_kept():
    c = one_slot()
    for i in range(10):
        refuse_and_lapse(c, "quitter", i, now_ms=i * 1000)
    assert isinstance(c.decide(call("busy", "other", 20_000), 20_000 * MS), Admit)
    refusal = c.decide(call("loyal", "keeper", 20_000), 20_000 * MS)
    assert isinstance(refusal, Reject) and refusal.reserved
    c.release("other/busy")
    assert isinstance(c.decide(call("stranger", "other", 20_050), 20_050 * MS), Reject), "the slot is held"
    assert isinstance(c.decide(call("loyal", "keeper", 20_050, attempt=1), 20_050 * MS), Admit)
    assert c.events["taken"] == 1


def test_a_refused_retry_is_judged_apart_from_a_first_refusal():
    """A client that retries once comes back after its first refusal, never after its second."""
    follow = FollowThrough()
    for _ in range(20):
        follow.observe("t", again=False, came=True)
        follow.observe("t", again=True, came=False)
    assert follow.expects("t", again=False)
    assert not follow.expects("t", again=True)


def test_a_tenant_that_starts_retrying_is_trusted_again():
    follow = FollowThrough(explore_every=4)
    for _ in range(30):
        follow.observe("t", again=False, came=False)
    asked = [follow.expects("t", again=False) for _ in range(8)]
    assert asked == [False, False, False, True] * 2, "every 4th unbacked refusal reserves, to learn"
    for _ in range(10):
        follow.observe("t", again=False, came=True)
    assert follow.expects("t", again=False)


def test_the_rates_kept_are_bounded():
    follow = FollowThrough(max_tenants=3)
    for tenant in "abcd":
        follow.observe(tenant, again=False, came=False)
    assert len(follow.rates) == 3 and ("a", False) not in follow.rates
