"""Invoice lines show, beside their prompt tokens, those the prefix cache served (issue 33): summed per line and per
request kind, frozen with the invoice, and never part of an amount. On SQLite and PostgreSQL."""

from __future__ import annotations

import csv
import dataclasses
import io
import json

from billing.db import unit_of_work
from billing.invoices import InvoiceLineView, finalize_invoice, get_invoice
from billing.ledger import ingest_usage, query_usage
from billing.period import parse_period
from billing.render import render_invoice
from billing.tenants import create_tenant
from tests.billing import test_invoices
from tests.billing.conftest import Ledger
from tests.billing.test_invoices import AFTER_PERIOD_US, draft

billed = test_invoices.billed  # the fixture: acme's six calls of the month, none served by the cache
# of each call's 10 prompt tokens, those the cache served when initech makes acme's calls again
CACHED = {"r1": 0, "r2": 5, "r3": 10, "g1": 0, "g2": 5, "g3": 10}


def cached_again(ledger: Ledger) -> None:
    period = parse_period(test_invoices.PERIOD)
    with unit_of_work(ledger.sessions) as session:
        calls = query_usage(session, tenant="acme", start_us=period.start_us, end_us=period.end_us).records
        assert sorted(call.call_id for call in calls) == sorted(CACHED)
        create_tenant(session, "initech")
        ingest_usage(
            session,
            [
                dataclasses.replace(
                    call, call_id=f"i-{call.call_id}", tenant="initech", cached_prompt_tokens=CACHED[call.call_id]
                )
                for call in calls
            ],
        )


def test_each_line_and_kind_shows_the_cached_prompt_tokens_and_no_amount_changes(billed: Ledger) -> None:
    acme = draft(billed)
    cached_again(billed)
    initech = draft(billed, "initech")
    assert [line.cached_prompt_tokens for line in acme.lines] == [0] * 5
    # big at 10 (g1), big at 12 (g2 + g3) and its credit (g2 missed), tiny (r1 + r2 + r3) and its credit (r3 missed)
    assert [(line.kind.value, line.prompt_tokens, line.cached_prompt_tokens) for line in initech.lines] == [
        ("usage", 10, 0),
        ("usage", 20, 15),
        ("sla_credit", 10, 5),
        ("usage", 30, 15),
        ("sla_credit", 10, 10),
    ]
    assert [[(k.request_kind.value, k.cached_prompt_tokens) for k in line.request_kinds] for line in initech.lines] == [
        [("chat_constrained", 0)],
        [("plain", 5), ("chat", 10)],
        [("plain", 5)],
        [("plain", 0), ("chat", 5), ("constrained", 10)],
        [("constrained", 10)],
    ]
    for line in initech.lines:
        assert sum(kind.cached_prompt_tokens for kind in line.request_kinds) == line.cached_prompt_tokens
    # everything else, money first, is acme's to the micro-unit
    assert [without_counts(line) for line in initech.lines] == list(acme.lines)
    assert initech.total_micros == acme.total_micros == 6_570


def without_counts(line: InvoiceLineView) -> InvoiceLineView:
    kinds = tuple(dataclasses.replace(kind, cached_prompt_tokens=0) for kind in line.request_kinds)
    return dataclasses.replace(line, cached_prompt_tokens=0, request_kinds=kinds)


def test_json_and_html_show_the_count_beside_the_prompt_tokens_and_the_csv_is_unchanged(billed: Ledger) -> None:
    acme = draft(billed)
    cached_again(billed)
    initech = draft(billed, "initech")
    lines = json.loads(render_invoice(initech, "json"))["lines"]
    assert [(line["prompt_tokens"], line["cached_prompt_tokens"]) for line in lines] == [
        (10, 0),
        (20, 15),
        (10, 5),
        (30, 15),
        (10, 10),
    ]
    assert list(lines[1])[list(lines[1]).index("prompt_tokens") + 1] == "cached_prompt_tokens"
    assert [k["cached_prompt_tokens"] for k in lines[3]["request_kinds"]] == [0, 5, 10]
    page = render_invoice(initech, "html")
    assert "<th>Cached tokens in</th>" in page and "<td>15</td>" in page
    for by_request_kind in (False, True):  # the columns scripts parse: the same as an invoice without cache hits
        ours, theirs = (
            [
                {k: v for k, v in row.items() if k not in ("invoice_id", "tenant")}
                for row in csv.DictReader(io.StringIO(render_invoice(invoice, "csv", by_request_kind=by_request_kind)))
            ]
            for invoice in (initech, acme)
        )
        assert ours == theirs and "cached_prompt_tokens" not in ours[0]


def test_a_finalized_invoice_keeps_its_counts(billed: Ledger) -> None:
    cached_again(billed)
    invoice = draft(billed, "initech")
    with unit_of_work(billed.sessions) as session:
        finalized = finalize_invoice(session, invoice.id, now_us=AFTER_PERIOD_US)
    with billed.sessions() as session:
        again = get_invoice(session, invoice.id)
    assert [line.cached_prompt_tokens for line in again.lines] == [0, 15, 5, 15, 10]
    assert again.lines == finalized.lines == invoice.lines
