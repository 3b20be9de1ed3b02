"""Invoices: totals against the ledger, SLA credits, one draft per month, immutability."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError

from billing.db import unit_of_work
from billing.errors import (
    CreditExceedsInvoice,
    CurrencyMismatch,
    InvoiceFinalized,
    InvoiceState,
    MissingPrice,
    UnknownTenant,
)
from billing.invoice_kinds import RequestKindUsage, allocate
from billing.invoices import (
    create_or_refresh_draft,
    finalize_invoice,
    get_invoice,
    issue_credit_note,
    list_invoices,
    void_invoice,
)
from billing.ledger import ingest_usage, query_usage
from billing.models import Invoice, InvoiceStatus, LineKind
from billing.period import parse_period
from billing.pricing import add_price, cost_micros
from billing.records import Door, RequestKind
from billing.render import render_invoice
from billing.tenants import create_tenant
from tests.billing.conftest import Ledger
from tests.billing.factories import PERIOD, START_US, gpu_usage, missed, usage

MID_MONTH_US = START_US + 15 * 86_400_000_000
AFTER_PERIOD_US = parse_period(PERIOD).end_us + 1


@pytest.fixture
def billed(ledger: Ledger) -> Ledger:
    """Two tenants, two models, a price change mid-month, missed deadlines, usage outside the month, request kinds."""
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
        create_tenant(session, "globex")
        add_price(session, "tiny", "core_us", 1_500, "USD", 0)
        add_price(session, "big", "sm_us", 10, "USD", 0)
        add_price(session, "big", "sm_us", 12, "USD", MID_MONTH_US)
        ingest_usage(
            session,
            [
                usage("r1", unit_us=1_000_000),
                usage("r2", unit_us=2_500_000, labels={}, request_kind="chat"),
                missed("r3", unit_us=333_333, request_kind="constrained"),
                gpu_usage(
                    "g1",
                    model="big",
                    unit_us=132_000_000,
                    finished_at_us=MID_MONTH_US - 1,
                    request_kind="chat_constrained",
                ),
                missed(
                    "g2",
                    model="big",
                    device_kind="cuda",
                    device_id="GPU-0000-test",
                    unit="sm_us",
                    unit_us=66_000_001,
                    finished_at_us=MID_MONTH_US,
                ),
                gpu_usage("g3", model="big", unit_us=1, finished_at_us=MID_MONTH_US + 5, request_kind="chat"),
                usage("other-tenant", tenant="globex", unit_us=7_000_000),
                usage("last-month", unit_us=9_000_000, finished_at_us=START_US - 1),
                usage("next-month", unit_us=9_000_000, finished_at_us=parse_period(PERIOD).end_us),
            ],
        )
    return ledger


def draft(ledger: Ledger, tenant: str = "acme"):
    with unit_of_work(ledger.sessions) as session:
        return create_or_refresh_draft(session, tenant, PERIOD)


def ledger_implied_total(ledger: Ledger, tenant: str) -> int:
    """Recompute from the raw rows with plain SQL: per model, unit and price, charge all, credit misses."""
    period = parse_period(PERIOD)
    sql = text(
        "SELECT u.model, u.unit, u.finished_at_us, u.unit_us, u.deadline_met FROM usage_records u "
        "JOIN tenants t ON t.id = u.tenant_id WHERE t.name = :tenant "
        "AND u.finished_at_us >= :start AND u.finished_at_us < :end"
    )
    with ledger.sessions() as session:
        rows = session.execute(sql, dict(tenant=tenant, start=period.start_us, end=period.end_us)).all()
        prices = session.execute(text("SELECT model, unit, effective_from_us, price_micros FROM prices")).all()
    sums: dict[tuple, list[int]] = {}
    for model, unit, finished, unit_us, met in rows:
        version = max((p for p in prices if p[:2] == (model, unit) and p[2] <= finished), key=lambda p: p[2])
        bucket = sums.setdefault((model, unit, version[3]), [0, 0])
        bucket[0] += unit_us
        bucket[1] += 0 if met else unit_us
    return sum(cost_micros(total, price) - cost_micros(miss, price) for (_, _, price), (total, miss) in sums.items())


def test_totals_equal_lines_and_the_ledger_rows(billed: Ledger) -> None:
    invoice = draft(billed)
    summary = [
        (ln.model, ln.kind, ln.price_micros, ln.num_requests, ln.unit_us, ln.amount_micros) for ln in invoice.lines
    ]
    assert summary == [
        ("big", LineKind.USAGE, 10, 1, 132_000_000, 1_320),
        ("big", LineKind.USAGE, 12, 2, 66_000_002, 792),  # 792.000024 rounds down
        ("big", LineKind.SLA_CREDIT, 12, 1, 66_000_001, -792),
        ("tiny", LineKind.USAGE, 1_500, 3, 3_833_333, 5_750),  # 5749.9995 rounds half up
        ("tiny", LineKind.SLA_CREDIT, 1_500, 1, 333_333, -500),  # 499.9995 → 500
    ]
    assert invoice.total_micros == sum(line.amount_micros for line in invoice.lines) == 6_570
    assert invoice.total_micros == ledger_implied_total(billed, "acme")
    assert draft(billed, "globex").total_micros == ledger_implied_total(billed, "globex") == 10_500
    assert [line.position for line in invoice.lines] == list(range(5))
    period = parse_period(PERIOD)
    assert [(ln.usage_from_us, ln.usage_to_us) for ln in invoice.lines] == [
        (period.start_us, MID_MONTH_US),
        *[(MID_MONTH_US, period.end_us)] * 2,
        *[(period.start_us, period.end_us)] * 2,
    ]
    assert invoice.currency == "USD" and invoice.status is InvoiceStatus.DRAFT


def test_each_line_lists_its_request_kinds_which_add_up_to_it(billed: Ledger) -> None:
    """The kinds split each line (above: lines and total as they were); a line's amount goes to its kinds by their
    unit·µs, largest remainder first, so they add up to the line exactly."""
    invoice = draft(billed)
    plain, chat, constrained, both = RequestKind
    assert [line.request_kinds for line in invoice.lines] == [
        (RequestKindUsage(both, 1, 132_000_000, 10, 20, 1_320),),
        (RequestKindUsage(plain, 1, 66_000_001, 10, 20, 792), RequestKindUsage(chat, 1, 1, 10, 20, 0)),
        (RequestKindUsage(plain, 1, 66_000_001, 10, 20, -792),),  # only the plain call missed
        (
            RequestKindUsage(plain, 1, 1_000_000, 10, 20, 1_500),
            RequestKindUsage(chat, 1, 2_500_000, 10, 20, 3_750),
            RequestKindUsage(constrained, 1, 333_333, 10, 20, 500),  # 499.9996: the largest remainder
        ),
        (RequestKindUsage(constrained, 1, 333_333, 10, 20, -500),),
    ]
    numbers = ("num_requests", "unit_us", "prompt_tokens", "completion_tokens", "amount_micros")
    for line in invoice.lines:
        assert [sum(getattr(k, name) for k in line.request_kinds) for name in numbers] == [
            getattr(line, name) for name in numbers
        ]
    assert draft(billed).lines == invoice.lines  # a refresh rebuilds the same kinds


@settings(max_examples=300, deadline=None)
@given(st.integers(-(10**15), 10**15), st.lists(st.integers(0, 10**12), min_size=1, max_size=4).filter(any))
def test_an_amount_is_allocated_exactly_and_in_proportion(amount: int, weights: list[int]) -> None:
    parts = allocate(amount, weights)
    assert sum(parts) == amount
    for part, weight in zip(parts, weights, strict=True):
        assert abs(part - amount * weight / sum(weights)) < 1
        assert weight or part == 0
    assert allocate(10, [1, 1, 1]) == [4, 3, 3] and allocate(-10, [1, 1, 1]) == [-4, -3, -3]


# The columns scripts parse, as they were before request kinds: the default CSV never changes them.
CSV_HEADER = (
    "invoice_id,tenant,period,status,currency,position,kind,model,unit,service_class,price_micros,num_requests,"
    "unit_us,prompt_tokens,completion_tokens,amount_micros,amount"
)


def test_the_invoice_shows_its_kinds_and_its_csv_splits_lines_by_kind_only_when_asked(billed: Ledger) -> None:
    invoice = draft(billed)
    lines = json.loads(render_invoice(invoice, "json"))["lines"]
    assert [[(k["request_kind"], k["amount_micros"]) for k in line["request_kinds"]] for line in lines] == [
        [("chat_constrained", 1_320)],
        [("plain", 792), ("chat", 0)],
        [("plain", -792)],
        [("plain", 1_500), ("chat", 3_750), ("constrained", 500)],
        [("constrained", -500)],
    ]
    assert lines[3]["request_kinds"][1]["amount"] == "0.003750"

    plain_csv = list(csv.DictReader(io.StringIO(render_invoice(invoice, "csv"))))
    assert render_invoice(invoice, "csv").splitlines()[0] == CSV_HEADER
    assert len(plain_csv) == len(invoice.lines) + 1  # and the total

    text_by_kind = render_invoice(invoice, "csv", by_request_kind=True)
    assert text_by_kind.splitlines()[0] == CSV_HEADER + ",request_kind"
    by_kind = list(csv.DictReader(io.StringIO(text_by_kind)))
    billed_rows = [row for row in by_kind if row["kind"] in ("usage", "sla_credit")]
    assert [(row["position"], row["request_kind"], row["amount_micros"]) for row in billed_rows] == [
        (str(line.position), kind.request_kind.value, str(kind.amount_micros))
        for line in invoice.lines
        for kind in line.request_kinds
    ]
    assert sum(int(row["amount_micros"]) for row in billed_rows) == invoice.total_micros
    (total,) = [row for row in by_kind if row["kind"] == "total"]
    assert (int(total["amount_micros"]), total["request_kind"]) == (invoice.total_micros, "")
    assert {row["num_requests"] for row in by_kind if row["position"] == "4"} == {"1"}

    page = render_invoice(invoice, "html")
    assert "Usage by request kind" in page and "<td>chat_constrained</td>" in page


def test_an_invoice_is_the_same_whatever_door_its_calls_came_through(billed: Ledger) -> None:
    """Two more tenants make acme's calls again, one through alternating doors, one all over HTTP: the door labels
    the usage and prices nothing, so their invoices have acme's lines, kinds and total, to the micro-unit."""
    period = parse_period(PERIOD)
    with unit_of_work(billed.sessions) as session:
        calls = query_usage(session, tenant="acme", start_us=period.start_us, end_us=period.end_us).records
        assert {call.door for call in calls} == {Door.GRPC} and len(calls) == 6
        for tenant, door_of in (("initech", lambda i: list(Door)[i % 2]), ("hooli", lambda i: Door.HTTP)):
            create_tenant(session, tenant)
            again = [
                dataclasses.replace(call, call_id=f"{tenant}-{call.call_id}", tenant=tenant, door=door_of(i))
                for i, call in enumerate(calls)
            ]
            assert [r.status.value for r in ingest_usage(session, again)] == ["accepted"] * len(calls)
    acme = draft(billed)
    for tenant, doors in (("initech", set(Door)), ("hooli", {Door.HTTP})):
        with billed.sessions() as session:
            stored = query_usage(session, tenant=tenant, start_us=period.start_us, end_us=period.end_us).records
        assert {call.door for call in stored} == doors
        invoice = draft(billed, tenant)
        assert invoice.lines == acme.lines and invoice.total_micros == acme.total_micros == 6_570


def test_generating_a_draft_again_refreshes_the_same_invoice(billed: Ledger) -> None:
    first = draft(billed)
    with unit_of_work(billed.sessions) as session:
        ingest_usage(session, [usage("r4", unit_us=1_000_000)])
    second = draft(billed)
    assert second.id == first.id
    assert second.total_micros == first.total_micros + 1_500 == ledger_implied_total(billed, "acme")
    with billed.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Invoice)) == 1
    with pytest.raises(IntegrityError), unit_of_work(billed.sessions) as session:  # the DB keeps it at one
        session.execute(
            text(
                "INSERT INTO invoices (tenant_id, period, status, currency, total_micros, period_start_us, "
                "period_end_us, created_at_us, refreshed_at_us) SELECT tenant_id, period, 'draft', currency, 0, "
                "period_start_us, period_end_us, 0, 0 FROM invoices"
            )
        )


def test_concurrent_draft_generation_yields_one_invoice(billed: Ledger) -> None:
    ids: list[int] = []
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            ids.append(draft(billed).id)
        except BaseException as error:  # surfaced by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=generate) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(set(ids)) == 1 and len(ids) == 4


def finalized(ledger: Ledger):
    invoice = draft(ledger)
    with unit_of_work(ledger.sessions) as session:
        return finalize_invoice(session, invoice.id, now_us=AFTER_PERIOD_US)


def test_a_month_is_finalized_only_after_it_ended(billed: Ledger) -> None:
    invoice = draft(billed)
    with pytest.raises(InvoiceState, match="has not ended"), unit_of_work(billed.sessions) as session:
        finalize_invoice(session, invoice.id, now_us=AFTER_PERIOD_US - 2)


def test_finalized_invoices_refuse_changes_in_code(billed: Ledger) -> None:
    invoice = finalized(billed)
    assert invoice.status is InvoiceStatus.FINALIZED and invoice.finalized_at_us == AFTER_PERIOD_US
    with unit_of_work(billed.sessions) as session:
        ingest_usage(session, [usage("late", unit_us=5_000_000)])
    with pytest.raises(InvoiceFinalized) as caught, unit_of_work(billed.sessions) as session:
        create_or_refresh_draft(session, "acme", PERIOD)
    assert caught.value.field == "invoice_id"
    with pytest.raises(InvoiceFinalized), unit_of_work(billed.sessions) as session:
        finalize_invoice(session, invoice.id, now_us=AFTER_PERIOD_US)
    with billed.sessions() as session:
        assert get_invoice(session, invoice.id) == invoice


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE invoices SET total_micros = 0",
        "UPDATE invoices SET status = 'draft'",
        "UPDATE invoices SET status = 'void', total_micros = 1",
        "DELETE FROM invoices",
        "UPDATE invoice_lines SET amount_micros = 0",
        "DELETE FROM invoice_lines",
        "UPDATE invoice_line_request_kinds SET amount_micros = 0",
        "DELETE FROM invoice_line_request_kinds",
        "INSERT INTO invoice_lines (invoice_id, position, kind, model, unit, price_id, price_micros, "
        "usage_from_us, usage_to_us, num_requests, unit_us, prompt_tokens, completion_tokens, amount_micros) "
        "SELECT invoice_id, 99, kind, model, unit, price_id, price_micros, usage_from_us, usage_to_us, "
        "num_requests, unit_us, prompt_tokens, completion_tokens, amount_micros FROM invoice_lines "
        "WHERE position = 0",
    ],
)
def test_finalized_invoices_refuse_raw_sql(billed: Ledger, sql: str) -> None:
    invoice = finalized(billed)
    with pytest.raises(IntegrityError) as caught, unit_of_work(billed.sessions) as session:
        session.execute(text(sql))
    assert "refused" in str(caught.value.orig)
    with billed.sessions() as session:
        assert get_invoice(session, invoice.id) == invoice


def test_drafts_stay_editable_in_the_database(billed: Ledger) -> None:
    invoice = draft(billed)
    with unit_of_work(billed.sessions) as session:  # the triggers only guard finalized and void invoices
        session.execute(text("DELETE FROM invoice_lines WHERE position = 0"))
    assert len(draft(billed).lines) == len(invoice.lines)  # and the next refresh rebuilds the lines


def test_void_then_reissue(billed: Ledger) -> None:
    original = finalized(billed)
    with unit_of_work(billed.sessions) as session:
        voided = void_invoice(session, original.id, now_us=AFTER_PERIOD_US + 1)
        ingest_usage(session, [usage("late", unit_us=1_000_000)])
    assert voided.status is InvoiceStatus.VOID and voided.total_micros == original.total_micros
    with pytest.raises(IntegrityError), unit_of_work(billed.sessions) as session:
        session.execute(text("UPDATE invoices SET voided_at_us = 0"))
    with pytest.raises(InvoiceFinalized), unit_of_work(billed.sessions) as session:
        void_invoice(session, original.id)
    reissued = draft(billed)
    assert reissued.id != original.id and reissued.total_micros == original.total_micros + 1_500
    with billed.sessions() as session:
        assert [i.status for i in list_invoices(session, tenant="acme")] == [InvoiceStatus.VOID, InvoiceStatus.DRAFT]


def test_credit_notes_correct_finalized_invoices_only(billed: Ledger) -> None:
    open_draft = draft(billed)
    with pytest.raises(InvoiceState), unit_of_work(billed.sessions) as session:
        issue_credit_note(session, open_draft.id, 100, "goodwill")
    with pytest.raises(IntegrityError, match="finalized"), unit_of_work(billed.sessions) as session:
        session.execute(
            text(
                "INSERT INTO credit_notes (invoice_id, amount_micros, currency, reason, created_at_us) "
                f"VALUES ({open_draft.id}, 5, 'USD', 'raw', 0)"
            )
        )
    invoice = finalized(billed)
    with unit_of_work(billed.sessions) as session:
        note = issue_credit_note(session, invoice.id, 570, "outage on the 3rd", now_us=AFTER_PERIOD_US)
    with pytest.raises(CreditExceedsInvoice) as caught, unit_of_work(billed.sessions) as session:
        issue_credit_note(session, invoice.id, 6_001, "too much")
    assert caught.value.field == "amount_micros"
    with billed.sessions() as session:
        after = get_invoice(session, invoice.id)
    assert after.credit_notes == (note,)
    assert (after.total_micros, after.credited_micros, after.balance_micros) == (6_570, 570, 6_000)
    with pytest.raises(IntegrityError), unit_of_work(billed.sessions) as session:
        session.execute(text("UPDATE credit_notes SET amount_micros = 1"))


def test_pricing_gaps_and_mixed_currencies_are_errors(ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
        ingest_usage(session, [usage("r1"), gpu_usage("g1", model="big")])
        add_price(session, "tiny", "core_us", 1, "USD", 0)
    with pytest.raises(MissingPrice) as missing, unit_of_work(ledger.sessions) as session:
        create_or_refresh_draft(session, "acme", PERIOD)
    assert (missing.value.model, missing.value.unit) == ("big", "sm_us")
    with unit_of_work(ledger.sessions) as session:
        add_price(session, "big", "sm_us", 1, "EUR", 0)
    with pytest.raises(CurrencyMismatch), unit_of_work(ledger.sessions) as session:
        create_or_refresh_draft(session, "acme", PERIOD)


def test_an_idle_month_and_an_unknown_tenant(ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
        empty = create_or_refresh_draft(session, "acme", PERIOD)
        with pytest.raises(UnknownTenant):
            create_or_refresh_draft(session, "initech", PERIOD)
    assert empty.lines == () and empty.total_micros == 0
