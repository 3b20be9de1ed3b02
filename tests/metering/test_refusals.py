"""Each request the ledger cannot take gets its precise code, naming the field, on SQLite and PostgreSQL."""

from __future__ import annotations

import base64
import json
import secrets

import grpc
import pytest
from zeroqueue.metering.v1 import metering_pb2 as pb

from billing.db import unit_of_work
from billing.ledger import filter_fingerprint, ingest_usage
from billing.page_tokens import encode_page_token
from billing.period import parse_period
from billing.records import MAX_INT64, MAX_RECORD_WALL_US
from tests.billing.conftest import Ledger
from tests.billing.factories import usage
from tests.metering.conftest import Keys, bearer, failed
from tests.metering.harness import MeteringThread
from tests.metering.test_servicer import bad_field, reason, record, send, stored_rows

U = grpc.StatusCode
PAST = "2021-03"
PAST_START_US = parse_period(PAST).start_us


def raw(call_id: str, **fields) -> pb.UsageRecord:  # type: ignore[no-untyped-def]
    """A record as a client may send it: valid, then with `fields` set past any validation."""
    message = record("placeholder", finished_at_us=fields.pop("finished_at_us", PAST_START_US + 1))
    message.call_id = call_id
    for name, value in fields.items():
        setattr(message, name, value)
    return message


def test_a_huge_unit_us_is_refused_alone_and_the_month_still_bills(stub, keys: Keys, ledger: Ledger) -> None:
    reply = send(
        stub,
        keys.admin,
        raw("ok"),
        raw("huge", unit_us=2**62),
        raw("past-a-month", unit_us=4 * MAX_RECORD_WALL_US + 1),
        raw("many-tokens", prompt_tokens=2**31 - 1),
    )
    assert [(r.id, r.status) for r in reply.records] == [
        ("ok", pb.RECORD_STATUS_ACCEPTED),
        ("huge", pb.RECORD_STATUS_INVALID),
        ("past-a-month", pb.RECORD_STATUS_INVALID),
        ("many-tokens", pb.RECORD_STATUS_ACCEPTED),
    ]
    assert reply.records[1].message.startswith("unit_us must be in [0, ") and stored_rows(ledger) == 2
    for key, tenant in ((keys.acme, ""), (keys.admin, "acme")):
        invoice = stub.CreateInvoice(pb.CreateInvoiceRequest(tenant=tenant, period=PAST), metadata=bearer(key))
        assert [line.quantity_unit_us for line in invoice.lines] == [2_000_000]
    report = stub.GetChargebackReport(
        pb.GetChargebackReportRequest(period=PAST, group_by=["tenant"]), metadata=bearer(keys.admin)
    )
    assert [(dict(r.group), r.unit_us, r.prompt_tokens) for r in report.rows] == [
        ({"tenant": "acme"}, 2_000_000, 10 + 2**31 - 1)
    ]


@pytest.mark.parametrize("period", ["２０２６-１２", "٢٠٢٦-١٢", "२०२६-१२", "2026-１2"])
def test_a_month_spelt_in_other_digits_is_invalid_argument(stub, keys: Keys, period: str) -> None:
    own = stub.CreateInvoice(pb.CreateInvoiceRequest(period="2026-12"), metadata=bearer(keys.acme))
    for method, request, key in (
        (stub.CreateInvoice, pb.CreateInvoiceRequest(period=period), keys.acme),
        (stub.CreateInvoice, pb.CreateInvoiceRequest(tenant="acme", period=period), keys.admin),
        (stub.ListInvoices, pb.ListInvoicesRequest(period=period), keys.acme),
        (stub.GetChargebackReport, pb.GetChargebackReportRequest(period=period), keys.admin),
    ):
        error = failed(method, request, key)
        assert (error.code(), bad_field(error), reason(error)) == (U.INVALID_ARGUMENT, "period", "INVALID_PERIOD")
    listed = stub.ListInvoices(pb.ListInvoicesRequest(), metadata=bearer(keys.acme)).invoices
    assert [(i.id, i.period) for i in listed] == [(own.id, "2026-12")]  # one invoice for the month


@pytest.mark.parametrize(
    "method, message, key, field",
    [
        ("QueryUsage", pb.QueryUsageRequest(model="ti\x00ny"), "acme", "model"),
        ("QueryUsage", pb.QueryUsageRequest(tenant="acme\x00"), "admin", "tenant"),
        ("QueryUsage", pb.QueryUsageRequest(tenant="acme\x00"), "acme", "tenant"),
        ("QueryUsage", pb.QueryUsageRequest(labels={"team": "a\x00"}), "acme", "labels.team"),
        ("CreateInvoice", pb.CreateInvoiceRequest(tenant="\x00", period=PAST), "admin", "tenant"),
        ("ListInvoices", pb.ListInvoicesRequest(tenant="globex\x00"), "admin", "tenant"),
        ("ListInvoices", pb.ListInvoicesRequest(period="2021-03\x00"), "acme", "period"),
        ("GetChargebackReport", pb.GetChargebackReportRequest(period=PAST, tenant="a\x00"), "admin", "tenant"),
        ("GetChargebackReport", pb.GetChargebackReportRequest(period=PAST, group_by=["team\x00"]), "acme", "group_by"),
    ],
)
def test_a_nul_byte_is_invalid_argument_naming_its_field(stub, keys: Keys, method, message, key, field) -> None:
    error = failed(getattr(stub, method), message, getattr(keys, key))
    assert (error.code(), bad_field(error)) == (U.INVALID_ARGUMENT, field)


def test_a_record_with_a_nul_byte_is_refused_alone(stub, keys: Keys, ledger: Ledger) -> None:
    reply = send(stub, keys.admin, raw("fine"), raw("nul\x00id"), raw("nul-model", model="m\x00"))
    assert [r.status for r in reply.records] == [
        pb.RECORD_STATUS_ACCEPTED,
        pb.RECORD_STATUS_INVALID,
        pb.RECORD_STATUS_INVALID,
    ]
    assert reply.records[2].message.startswith("model") and stored_rows(ledger) == 1


@pytest.mark.parametrize("invoice_id", [2**31, 2**40, MAX_INT64, -1, -(2**63)])
def test_an_invoice_id_outside_the_column_is_invalid_argument_for_every_key(stub, keys: Keys, invoice_id) -> None:
    for method, request in (
        (stub.GetInvoice, pb.GetInvoiceRequest(invoice_id=invoice_id)),
        (stub.FinalizeInvoice, pb.FinalizeInvoiceRequest(invoice_id=invoice_id)),
    ):
        error = failed(method, request, keys.admin)
        assert (error.code(), bad_field(error)) == (U.INVALID_ARGUMENT, "invoice_id")
    error = failed(stub.GetInvoice, pb.GetInvoiceRequest(invoice_id=invoice_id), keys.acme)
    assert (error.code(), bad_field(error)) == (U.INVALID_ARGUMENT, "invoice_id")


def test_another_tenants_invoice_is_refused_like_one_that_does_not_exist(stub, keys: Keys) -> None:
    send(stub, keys.admin, record("g1", tenant="globex", finished_at_us=PAST_START_US + 1))
    theirs = stub.CreateInvoice(pb.CreateInvoiceRequest(tenant="globex", period=PAST), metadata=bearer(keys.admin))
    refusals = [
        failed(stub.GetInvoice, pb.GetInvoiceRequest(invoice_id=invoice_id), keys.acme)
        for invoice_id in (theirs.id, 2**31 - 1)
    ]
    for error in refusals:
        assert (error.code(), reason(error)) == (U.PERMISSION_DENIED, "PERMISSION_DENIED")
        assert error.details().startswith("invoice_id: ")
        assert "globex" not in error.details() and "globex" not in str(error.trailing_metadata())
    assert refusals[0].details().replace(str(theirs.id), "N") == refusals[1].details().replace(str(2**31 - 1), "N")
    assert failed(stub.GetInvoice, pb.GetInvoiceRequest(invoice_id=2**31 - 1), keys.admin).code() == U.NOT_FOUND
    error = failed(stub.QueryUsage, pb.QueryUsageRequest(tenant="globex"), keys.acme)
    assert error.code() == U.PERMISSION_DENIED and "globex" not in error.details()


def forged_tokens(real: str) -> list[str]:
    body, tag = real.split(".")
    fingerprint = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))["q"]
    unsigned = (
        base64.urlsafe_b64encode(json.dumps({"v": 1, "q": fingerprint, "after": [2**70, -1]}).encode())
        .decode()
        .rstrip("=")
    )
    flipped = tag[:-1] + ("A" if tag[-1] != "A" else "B")
    return [
        unsigned,  # the old, unsigned form
        f"{body}.{flipped}",  # tampered signature
        encode_page_token(secrets.token_bytes(32), fingerprint, MAX_INT64, MAX_INT64),  # another ledger's
        body[:-2] + "xx." + tag,  # tampered position
        "x" * 10_000,
        "not.a.token",
        "é.ü",
        ".",
        "",
    ]


def test_a_forged_or_tampered_page_token_is_invalid_argument(stub, keys: Keys, ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        ingest_usage(session, [usage(f"r{i}", finished_at_us=PAST_START_US + i) for i in range(3)])
    for key in (keys.admin, keys.acme):
        real = stub.QueryUsage(pb.QueryUsageRequest(page_size=1), metadata=bearer(key)).next_page_token
        for token in [t for t in forged_tokens(real) if t]:
            error = failed(stub.QueryUsage, pb.QueryUsageRequest(page_size=1, page_token=token), key)
            assert (error.code(), bad_field(error), reason(error)) == (
                U.INVALID_ARGUMENT,
                "page_token",
                "INVALID_PAGE_TOKEN",
            ), token
    assert filter_fingerprint(0, 1, None, {}, None) != filter_fingerprint(0, 1, "acme", {}, None)


def test_a_page_token_survives_a_restart_and_works_on_any_server_of_the_ledger(
    stub, keys: Keys, ledger: Ledger
) -> None:
    with unit_of_work(ledger.sessions) as session:
        ingest_usage(session, [usage(f"r{i}", finished_at_us=PAST_START_US + i) for i in range(3)])
    first = stub.QueryUsage(pb.QueryUsageRequest(page_size=2), metadata=bearer(keys.acme))
    with MeteringThread(ledger.url) as other, other.channel() as channel:
        rest = other.stub(channel).QueryUsage(
            pb.QueryUsageRequest(page_size=2, page_token=first.next_page_token), metadata=bearer(keys.acme), timeout=30
        )
    assert [r.call_id for r in (*first.records, *rest.records)] == ["r0", "r1", "r2"]
    assert rest.next_page_token == ""
