"""read_serving_policy: classes, prices in force, tenants' weights, caps and month-to-date use counted once and
priced as the invoice prices it; and its wire form both ways."""

from __future__ import annotations

import threading

import pytest
from zeroqueue.metering.v1 import metering_pb2 as pb

from billing.db import make_engine, session_factory, unit_of_work
from billing.invoices import create_or_refresh_draft
from billing.ledger import IngestStatus, ingest_usage
from billing.models import PPM
from billing.period import parse_period
from billing.policy import DEVICE_CAP, SPEND_CAP, STANDARD, ClassSpec, PriceQuote, ServingPolicy, TenantQuota
from billing.pricing import add_price
from billing.service_classes import add_class, set_tenant_policy
from billing.serving_policy import read_serving_policy
from billing.tenants import create_tenant
from services.metering.policy_wire import policy_from_proto, policy_to_proto
from tests.billing.conftest import Ledger
from tests.billing.factories import PERIOD, START_US, missed, usage

NOW_US = START_US + 15 * 86_400_000_000  # mid-month: the month to date is PERIOD
NEXT_MONTH_US = parse_period("2026-11").start_us
INTERACTIVE = ClassSpec("interactive", 1, 2_000, 50, PPM)


@pytest.fixture
def policed(ledger: Ledger) -> Ledger:
    with unit_of_work(ledger.sessions) as session:
        for name in ("acme", "globex", "initech"):
            create_tenant(session, name)
        add_class(session, "interactive", max_budget_ms=2_000, priority=50, credit_ppm=PPM)
        add_class(session, "batch", min_budget_ms=1_000, credit_ppm=100_000)
        add_price(session, "tiny", "core_us", 1_500, "USD", 0)
        add_price(session, "tiny", "core_us", 2_000, "USD", START_US)
        add_price(session, "tiny", "core_us", 9_999, "USD", NOW_US + 1)  # not in force yet
        add_price(session, "tiny", "core_us", 3_000, "USD", 0, service_class="interactive")
        set_tenant_policy(session, "acme", weight=5, device_us_per_month=4_000_000, spend_micros_per_month=10**9)
        set_tenant_policy(session, "globex", weight=2, calls_per_s=50)
    return ledger


def replica_batch(prefix: str) -> list:
    return [
        usage(f"{prefix}-1", unit_us=1_000_000),
        usage(f"{prefix}-2", service_class="interactive", unit_us=2_000_000),
        missed(f"{prefix}-3", service_class="batch", unit_us=500_000),
    ]


def test_the_policy_holds_classes_prices_and_each_policed_tenant(policed: Ledger) -> None:
    with unit_of_work(policed.sessions) as session:
        ingest_usage(
            session,
            [
                *replica_batch("a"),
                usage("g-1", tenant="globex", unit_us=7_000_000),
                usage("i-1", tenant="initech", unit_us=9_000_000),  # no policy: not sent
                usage("last-month", unit_us=50_000_000, finished_at_us=START_US - 1),
                usage("unpriced", model="nameless", unit_us=1_000_000),  # no price: device time, no spend
            ],
        )
        policy = read_serving_policy(session, NOW_US)
    assert policy.read_at_us == NOW_US
    assert policy.classes == (ClassSpec("batch", 1_000, 86_400_000, 0, 100_000), INTERACTIVE, STANDARD)
    assert policy.prices == (
        PriceQuote("tiny", "core_us", "", 2_000, "USD"),
        PriceQuote("tiny", "core_us", "interactive", 3_000, "USD"),
    )
    assert policy.price_of("tiny", "core_us", "batch") == policy.prices[0]
    assert set(policy.tenants) == {"acme", "globex"}
    acme, globex = policy.tenants["acme"], policy.tenants["globex"]
    assert (acme.weight, acme.device_us_per_month, acme.spend_micros_per_month, acme.calls_per_s) == (
        5,
        4_000_000,
        10**9,
        None,
    )
    assert acme.used_device_us == 1_000_000 + 2_000_000 + 500_000 + 1_000_000
    # 1 s at 2,000 (generic) + 2 s at 3,000 (interactive) + 0.5 s at 2,000 less 10 % of it (batch)
    assert acme.spent_micros == 2_000 + 6_000 + 1_000 - 100
    assert acme.resets_at_us == NEXT_MONTH_US and acme.exhausted_cap == DEVICE_CAP
    # globex has no spend cap: its spend is not priced on every poll
    assert (globex.weight, globex.calls_per_s, globex.used_device_us, globex.spent_micros) == (2, 50, 7_000_000, 0)
    assert globex.exhausted_cap is None and policy.weight_of("initech") == 1


def test_spent_is_what_the_invoice_would_total(policed: Ledger) -> None:
    with unit_of_work(policed.sessions) as session:
        ingest_usage(session, [*replica_batch("a"), missed("a-4", unit_us=1_234_567)])
        spent = read_serving_policy(session, NOW_US).tenants["acme"].spent_micros
        assert spent == create_or_refresh_draft(session, "acme", PERIOD).total_micros
        set_tenant_policy(session, "acme", device_us_per_month=None, spend_micros_per_month=spent)
        assert read_serving_policy(session, NOW_US).tenants["acme"].exhausted_cap == SPEND_CAP


def test_two_replicas_shipping_the_same_records_count_once(policed: Ledger) -> None:
    """Two replicas (each its own engine on the same ledger) ship overlapping batches at once, and each ships
    its batch again (an outbox after a lost acknowledgement): each call counts once."""
    engines = [make_engine(policed.url) for _ in range(2)]
    batches = [replica_batch("a") + replica_batch("shared"), replica_batch("b") + replica_batch("shared")]
    statuses: list[list[IngestStatus]] = [[], []]
    start = threading.Barrier(2)

    def replica(index: int) -> None:
        sessions = session_factory(engines[index])
        start.wait()
        for _ in range(2):
            with unit_of_work(sessions) as session:
                statuses[index] += [r.status for r in ingest_usage(session, batches[index])]

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for engine in engines:
        engine.dispose()
    assert sum(s.count(IngestStatus.ACCEPTED) for s in statuses) == 9  # a-*, b-*, shared-*: once each
    assert IngestStatus.CONFLICT not in statuses[0] + statuses[1]
    with policed.sessions() as session:
        acme = read_serving_policy(session, NOW_US).tenants["acme"]
    assert acme.used_device_us == 3 * 3_500_000
    assert acme.spent_micros == 3 * (2_000 + 6_000 + 1_000 - 100)


def test_a_ledger_without_policies_sends_classes_and_prices_only(ledger: Ledger) -> None:
    with ledger.sessions() as session:
        policy = read_serving_policy(session, NOW_US)
    assert policy == ServingPolicy(classes=(STANDARD,), prices=(), tenants={}, read_at_us=NOW_US)


def test_the_wire_form_round_trips(policed: Ledger) -> None:
    with unit_of_work(policed.sessions) as session:
        ingest_usage(session, replica_batch("a"))
        policy = read_serving_policy(session, NOW_US)
    message = policy_to_proto(policy)
    again = policy_from_proto(pb.ServingPolicy.FromString(message.SerializeToString()))
    assert again == policy
    assert not message.tenants[0].HasField("calls_per_s") and message.tenants[1].calls_per_s == 50


def test_reading_the_wire_form_fills_what_an_older_server_leaves_out() -> None:
    policy = policy_from_proto(pb.ServingPolicy(tenants=[pb.TenantQuota(tenant="acme")]))
    assert policy.classes == (STANDARD,) and policy.class_for(30_000) == STANDARD
    assert policy.tenants["acme"] == TenantQuota("acme", weight=1)
    assert policy.tenants["acme"].exhausted_cap is None
