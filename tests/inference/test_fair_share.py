"""A fair share per tenant under overload: a flood takes what others leave, never what they need. Judged on the
virtual replica of steady_device.py (no torch, no clock: the same calls every run)."""

from __future__ import annotations

import pytest

from services.inference.admission import AdmissionConfig, AdmissionController, Commitment, Reject
from services.inference.admission.costmodel import CostModel
from services.inference.admission.shares import Shares
from tests.inference.steady_device import run
from tests.inference.test_retry_invitations import CAPACITY_PER_S, replica

S = 1_000_000_000


def flood_beside_modest(per_tenant: int, seed: int):
    controller = replica()
    controller.shares.per_tenant = per_tenant
    rates = {"flood": 4 * CAPACITY_PER_S, "modest": 0.4 * CAPACITY_PER_S}
    return run(controller, rates, 30.0, seed=seed, max_attempts=8)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_modest_tenant_beside_a_flood_is_served_nearly_as_if_alone(seed):
    alone = run(replica(), {"modest": 0.4 * CAPACITY_PER_S}, 30.0, seed=seed, max_attempts=8).by_tenant["modest"]
    first_come = flood_beside_modest(per_tenant=0, seed=seed)  # no slot kept for anyone: today's first come
    fair = flood_beside_modest(per_tenant=3, seed=seed)
    modest = fair.by_tenant["modest"]
    assert alone["admitted"] == alone["calls"]
    before = first_come.by_tenant["modest"]["admitted"] / first_come.by_tenant["modest"]["calls"]
    after = modest["admitted"] / modest["calls"]
    # issue 22's goal is 95 % admitted and 99 % of those in deadline: not reached yet (see OPERATIONS.md)
    assert after >= 0.8 and after >= before + 0.2, (before, after)
    assert modest["in_deadline"] >= 0.98 * modest["admitted"]
    # the flood has the rest, and the replica stays used: the slots kept in hand cost at most 5 % of goodput
    flood_alone = run(replica(), {"flood": 4 * CAPACITY_PER_S}, 30.0, seed=seed, max_attempts=8)
    assert fair.goodput(30.0) >= 0.95 * flood_alone.goodput(30.0)
    assert fair.by_tenant["flood"]["in_deadline"] >= 0.9 * (flood_alone.goodput(30.0) * 30 - modest["in_deadline"])


def test_the_refusal_of_a_borrower_names_its_share_and_invites_no_retry_here():
    cost = CostModel([1, 256], [10_000.0, 10_000.0], 0.0, num_deviations=0, deviation=0)
    c = AdmissionController(cost, AdmissionConfig(4, 256, margin_ms=0, margin_fraction=0))
    c.shares.per_tenant = 1

    def call(rid: str, tenant: str) -> Commitment:
        return Commitment(f"{tenant}/{rid}", 4, 5, 10 * S, tenant=tenant)

    c.decide(call("m0", "modest"), 0)  # the modest tenant is active, holding one slot of its two
    decisions = [c.decide(call(f"f{i}", "flood"), 0) for i in range(4)]
    # the flood takes its share and borrows, but the last free slot is kept for the tenant under its share
    assert [type(d).__name__ for d in decisions] == ["Admit", "Admit", "Reject", "Reject"]
    refused = decisions[2]
    assert isinstance(refused, Reject) and refused.reason == "over_share" and not refused.within_budget
    assert type(c.decide(call("m1", "modest"), 0)).__name__ == "Admit"  # it finds its slot at once


def test_shares_follow_the_weights_of_the_active_tenants():
    shares = Shares(12, weights={"big": 2.0})
    for tenant in ("big", "small"):
        shares.arrive(tenant, 0)
    assert shares.share("big", 0) == 8 and shares.share("small", 0) == 4
    for _ in range(9):
        shares.admit("big")
    assert shares.kept_free("big", 0) == 3 and shares.kept_free("small", 0) == 0
    assert shares.lent_to_others("small", 0) and not shares.lent_to_others("big", 0)
    # a tenant that stopped sending is forgotten after some half-lives: the other has every slot again
    assert shares.share("big", 20 * S) == 12 and shares.kept_free("big", 20 * S) == 0


def test_one_tenant_alone_borrows_nothing_and_is_kept_out_of_nothing():
    shares = Shares(4)
    shares.arrive("only", 0)
    for _ in range(4):
        shares.admit("only")
    assert shares.kept_free("only", 0) == 0 and not shares.lent_to_others("only", 0)


def test_refusals_are_counted_by_cause_and_tenant_with_the_tenants_bounded():
    from services.inference.metrics import MAX_TENANTS, ServiceMetrics

    metrics = ServiceMetrics()
    metrics.count_refusal("over_share", "flood")
    metrics.count_refusal("slots_full", "modest")
    for i in range(MAX_TENANTS + 5):
        metrics.count_refusal("slots_full", f"t{i}")
    value = metrics.registry.get_sample_value
    standard = {"service_class": "standard"}  # the class of a call that names none (services/inference/classes.py)
    assert value("zeroqueue_refusals_total", {"cause": "over_share", "tenant": "flood", **standard}) == 1
    assert value("zeroqueue_refusals_total", {"cause": "slots_full", "tenant": "_other", **standard}) == 7
