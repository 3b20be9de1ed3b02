"""Billing per class of service: records carry their class, each class is priced at its own price (else the
generic one) and credited by its own rule, on invoices and in chargeback."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from billing.aggregate import credit_micros
from billing.chargeback import chargeback_report
from billing.db import unit_of_work
from billing.errors import InvalidPrice, InvalidRecord, MissingPrice, PriceExists, UnknownClass
from billing.invoices import create_or_refresh_draft
from billing.ledger import IngestStatus, ingest_usage, query_usage
from billing.models import PPM, LineKind
from billing.pricing import GENERIC_PRICE, PriceSchedule, PriceVersion, add_price, cost_micros, price_at, price_history
from billing.render import render_invoice
from billing.service_classes import add_class
from billing.tenants import create_tenant
from tests.billing.conftest import Ledger
from tests.billing.factories import PERIOD, START_US, missed, usage

# usage("r-1")'s digest as computed before classes existed (billing/records.py at 4749f01): a record of class
# `standard` must keep it, or a replay of a record stored before 0005 would be a CONFLICT instead of a DUPLICATE
DIGEST_BEFORE_CLASSES = "a74d848949d7e4b74bd7a0441673025dbb2bdb269c76becbe81bd07b933748f4"
MID_MONTH_US = START_US + 15 * 86_400_000_000


# --- records -----------------------------------------------------------------------------------------------------


def test_a_record_names_its_class_and_empty_is_standard() -> None:
    assert usage("r").service_class == "standard"
    assert usage("r", service_class="").service_class == "standard"
    assert usage("r", service_class="batch-2_x").service_class == "batch-2_x"
    for bad in ("Batch", "a" * 33, "bad class", "batch\n", 7):
        with pytest.raises(InvalidRecord) as caught:
            usage("r", service_class=bad)
        assert caught.value.field == "service_class"


def test_the_digest_of_a_standard_record_is_the_one_from_before_classes() -> None:
    assert usage("r-1").payload_digest() == DIGEST_BEFORE_CLASSES
    assert usage("r-1", service_class="").payload_digest() == DIGEST_BEFORE_CLASSES
    assert usage("r-1", service_class="batch").payload_digest() != DIGEST_BEFORE_CLASSES
    again = usage("r-1", service_class="batch")
    assert type(again)(**again.to_payload()) == again  # the outbox's round trip keeps the class


def test_a_replay_without_a_class_is_a_duplicate_and_another_class_a_conflict(ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
        [stored] = ingest_usage(session, [usage("r-1")])
        ingest_usage(session, [usage("r-2", service_class="batch")])
    assert stored.stored_digest == DIGEST_BEFORE_CLASSES
    with unit_of_work(ledger.sessions) as session:
        results = ingest_usage(session, [usage("r-1", service_class=""), usage("r-1", service_class="batch")])
        assert [r.status for r in results] == [IngestStatus.DUPLICATE, IngestStatus.CONFLICT]
        page = query_usage(session, start_us=0, end_us=2**62)
    assert {r.call_id: r.service_class for r in page.records} == {"r-1": "standard", "r-2": "batch"}


# --- prices per class --------------------------------------------------------------------------------------------


@pytest.fixture
def classes(ledger: Ledger) -> Ledger:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
        add_class(session, "interactive", max_budget_ms=2_000, priority=50, credit_ppm=PPM)
        add_class(session, "batch", min_budget_ms=1_000, credit_ppm=100_000)
    return ledger


def test_add_price_for_a_class(classes: Ledger) -> None:
    with unit_of_work(classes.sessions) as session:
        generic = add_price(session, "tiny", "core_us", 2_000, "USD", 0)
        batch = add_price(session, "tiny", "core_us", 1_000, "USD", 0, service_class="batch")
        assert (generic.service_class, batch.service_class) == (GENERIC_PRICE, "batch")
        with pytest.raises(PriceExists, match="class 'batch'"):
            add_price(session, "tiny", "core_us", 900, "USD", 0, service_class="batch")
    for name, error in (("ghost", UnknownClass), ("Batch", InvalidPrice), ("x" * 40, InvalidPrice)):
        with pytest.raises(error) as caught, unit_of_work(classes.sessions) as session:
            add_price(session, "tiny", "core_us", 1, "USD", 0, service_class=name)
        assert caught.value.field == "service_class"
    with classes.sessions() as session:
        history = price_history(session, "tiny")
        assert [(v.service_class, v.price_micros) for v in history] == [("", 2_000), ("batch", 1_000)]
        assert [v.id for v in price_history(session, service_class="batch")] == [batch.id]
        assert price_at(session, "tiny", "core_us", 5, "batch") == batch
        assert price_at(session, "tiny", "core_us", 5, "interactive") == generic  # none of its own: the generic one
        assert price_at(session, "tiny", "core_us", 5) == generic


def test_the_schedule_prices_a_class_by_its_own_version_else_the_generic_one() -> None:
    generic = PriceVersion(1, "tiny", "core_us", 2_000, "USD", 0)
    generic_2 = PriceVersion(2, "tiny", "core_us", 2_500, "USD", 300)
    batch = PriceVersion(3, "tiny", "core_us", 1_000, "USD", 100, "batch")
    schedule = PriceSchedule([generic, generic_2, batch])
    assert schedule.version_at("tiny", "core_us", 50, "batch") == generic  # before batch's own
    assert schedule.valid_until(generic, "batch") == 100  # batch's own takes over
    assert schedule.version_at("tiny", "core_us", 100, "batch") == batch
    assert schedule.valid_until(batch, "batch") is None  # a generic change does not touch batch's own
    assert schedule.version_at("tiny", "core_us", 400, "batch") == batch
    assert schedule.version_at("tiny", "core_us", 400, "standard") == generic_2
    assert schedule.valid_until(generic, "standard") == 300
    assert schedule.in_force(150) == [generic, batch]
    with pytest.raises(MissingPrice, match="class 'batch'"):
        PriceSchedule([batch]).version_at("tiny", "core_us", 50, "batch")


def test_credit_is_rounded_once_half_up_and_never_above_the_charge() -> None:
    assert credit_micros(3_333_333, 1_000, PPM) == cost_micros(3_333_333, 1_000) == 3_333
    assert credit_micros(3_333_333, 1_000, 100_000) == 333  # 333.3333
    assert credit_micros(5_000_000, 1, 100_000) == 1  # 0.5: half up
    assert credit_micros(4_999_999, 1, 100_000) == 0
    assert credit_micros(7, 13, 0) == 0
    with pytest.raises(ValueError):
        credit_micros(1, 1, PPM + 1)


@pytest.fixture
def two_classes(classes: Ledger) -> Ledger:
    """interactive at 3,000 with 100 % credit, batch at 1,000 with 10 %, standard at the generic 2,000, and a
    class the ledger does not know (credited 100 %, priced generically)."""
    with unit_of_work(classes.sessions) as session:
        add_price(session, "tiny", "core_us", 2_000, "USD", 0)
        add_price(session, "tiny", "core_us", 3_000, "USD", 0, service_class="interactive")
        add_price(session, "tiny", "core_us", 1_000, "USD", 0, service_class="batch")
        ingest_usage(
            session,
            [
                usage("i1", service_class="interactive", unit_us=2_000_000),
                missed("i2", service_class="interactive", unit_us=1_000_000),
                usage("b1", service_class="batch", unit_us=4_000_000, labels={"team": "etl"}),
                missed("b2", service_class="batch", unit_us=3_333_333, labels={"team": "etl"}),
                usage("s1", unit_us=1_000_000),
                missed("x1", service_class="ghost", unit_us=1_000_000),
            ],
        )
    return classes


def test_an_invoice_bills_each_class_at_its_price_and_credits_it_by_its_rule(two_classes: Ledger) -> None:
    with unit_of_work(two_classes.sessions) as session, capture_logs() as logs:
        invoice = create_or_refresh_draft(session, "acme", PERIOD)
    assert [(e["event"], e["service_class"]) for e in logs if e["log_level"] == "warning"] == [
        ("billing.unknown_class", "ghost")
    ]
    lines = [(ln.service_class, ln.kind, ln.num_requests, ln.price_micros, ln.amount_micros) for ln in invoice.lines]
    assert lines == [
        ("batch", LineKind.USAGE, 2, 1_000, 7_333),  # 7,333,333 core·µs at 1,000
        ("batch", LineKind.SLA_CREDIT, 1, 1_000, -333),  # 10 % of 3,333.333, rounded once
        ("ghost", LineKind.USAGE, 1, 2_000, 2_000),  # an unknown class: the generic price ...
        ("ghost", LineKind.SLA_CREDIT, 1, 2_000, -2_000),  # ... and 100 % credit
        ("interactive", LineKind.USAGE, 2, 3_000, 9_000),
        ("interactive", LineKind.SLA_CREDIT, 1, 3_000, -3_000),
        ("standard", LineKind.USAGE, 1, 2_000, 2_000),
    ]
    assert invoice.total_micros == 15_000
    assert "class batch" in invoice.lines[0].description and "class" not in invoice.lines[6].description
    assert '"service_class": "interactive"' in render_invoice(invoice, "json")
    assert "service_class" in render_invoice(invoice, "csv").splitlines()[0]
    assert "<td>interactive</td>" in render_invoice(invoice, "html")


def test_a_class_price_from_mid_month_splits_its_lines_there(two_classes: Ledger) -> None:
    with unit_of_work(two_classes.sessions) as session:
        add_price(session, "tiny", "core_us", 500, "USD", MID_MONTH_US, service_class="batch")
        ingest_usage(session, [usage("b3", service_class="batch", unit_us=2_000_000, finished_at_us=MID_MONTH_US)])
        invoice = create_or_refresh_draft(session, "acme", PERIOD)
    batch = [line for line in invoice.lines if line.service_class == "batch" and line.kind is LineKind.USAGE]
    assert [(line.price_micros, line.amount_micros, line.usage_to_us) for line in batch] == [
        (1_000, 7_333, MID_MONTH_US),
        (500, 1_000, invoice.period_end_us),
    ]


def test_chargeback_groups_by_class_at_each_class_price(two_classes: Ledger) -> None:
    with two_classes.sessions() as session:
        report = chargeback_report(session, PERIOD, ["service_class"])
        by_team = chargeback_report(session, PERIOD, ["team", "service_class"])
    assert [(row.label, row.num_requests, row.num_deadline_met, row.cost_micros) for row in report.rows] == [
        ("batch", 2, 1, 7_000),
        ("ghost", 1, 0, 0),
        ("interactive", 2, 1, 6_000),
        ("standard", 1, 1, 2_000),
    ]
    assert sum(row.cost_micros for row in report.rows) == 15_000  # the invoice's total
    assert ("etl / batch", 7_000) in [(row.label, row.cost_micros) for row in by_team.rows]
