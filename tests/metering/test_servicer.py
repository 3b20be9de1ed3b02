"""The Metering service through gRPC on a loopback port, on SQLite and on PostgreSQL."""

from __future__ import annotations

import grpc
import pytest
from sqlalchemy import func, select
from structlog.testing import capture_logs
from zeroqueue.metering.v1 import metering_pb2 as pb

from billing.db import unit_of_work
from billing.ledger import ingest_usage
from billing.models import UsageConflict, UsageRow
from billing.period import parse_period
from billing.records import RequestKind
from services.metering.servicer import idle_to_pb, usage_from_pb, usage_to_pb
from tests.billing.conftest import Ledger
from tests.billing.factories import idle, missed, usage
from tests.inference.harness import status_details
from tests.metering.conftest import Keys, bearer, failed

PAST = "2021-03"  # long over, so its invoices can be finalized
PAST_START_US = parse_period(PAST).start_us
U = grpc.StatusCode


def record(call_id: str, **overrides) -> pb.UsageRecord:  # type: ignore[no-untyped-def]
    return usage_to_pb(usage(call_id, **overrides))


def send(stub, key: str, *records: pb.UsageRecord, idle_records=()) -> pb.RecordUsageResponse:  # type: ignore[no-untyped-def]
    return stub.RecordUsage(pb.RecordUsageRequest(records=records, idle=idle_records), metadata=bearer(key), timeout=30)


def stored_rows(ledger: Ledger, call_id: str | None = None) -> int:
    with ledger.sessions() as session:
        query = select(func.count()).select_from(UsageRow)
        if call_id is not None:
            query = query.where(UsageRow.call_id == call_id)
        return session.scalar(query)


def reason(error: grpc.RpcError) -> str:
    return status_details(error)["ErrorInfo"].reason


def bad_field(error: grpc.RpcError) -> str:
    return status_details(error)["BadRequest"].field_violations[0].field


# --- authentication and authorization ------------------------------------------------------------------------


@pytest.mark.parametrize("key", [None, "zq_not-a-key", "revoked"])
def test_missing_unknown_and_revoked_keys_are_unauthenticated(stub, keys: Keys, key: str | None) -> None:
    key = keys.revoked if key == "revoked" else key
    for method, request in (
        (stub.WhoAmI, pb.WhoAmIRequest()),
        (stub.QueryUsage, pb.QueryUsageRequest()),
        (stub.RecordUsage, pb.RecordUsageRequest(records=[record("r1")])),
        (stub.ListInvoices, pb.ListInvoicesRequest()),
    ):
        error = failed(method, request, key)
        assert error.code() == U.UNAUTHENTICATED, method
        assert reason(error) == "UNAUTHENTICATED" and "authorization" in error.details()


def test_a_key_that_is_not_bearer_is_missing(stub, keys: Keys) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.WhoAmI(pb.WhoAmIRequest(), metadata=(("authorization", f"Basic {keys.admin}"),), timeout=30)
    error = info.value
    assert error.code() == U.UNAUTHENTICATED and "missing API key" in error.details()


def test_who_am_i(stub, keys: Keys) -> None:
    assert stub.WhoAmI(pb.WhoAmIRequest(), metadata=bearer(keys.admin), timeout=30) == pb.Principal(role="admin")
    assert stub.WhoAmI(pb.WhoAmIRequest(), metadata=bearer(keys.acme), timeout=30) == pb.Principal(
        tenant="acme", role="tenant"
    )


def test_a_tenant_key_cannot_record_usage(stub, keys: Keys, ledger: Ledger) -> None:
    error = failed(stub.RecordUsage, pb.RecordUsageRequest(records=[record("r1")]), keys.acme)
    assert error.code() == U.PERMISSION_DENIED and "admin key" in error.details()
    assert stored_rows(ledger) == 0


def test_a_tenant_key_reaches_only_its_own_tenant(stub, keys: Keys) -> None:
    send(
        stub,
        keys.admin,
        record("a1", finished_at_us=PAST_START_US + 1),
        record("g1", tenant="globex", finished_at_us=PAST_START_US + 2),
    )
    theirs = stub.CreateInvoice(pb.CreateInvoiceRequest(tenant="globex", period=PAST), metadata=bearer(keys.admin))
    denied = [
        (stub.QueryUsage, pb.QueryUsageRequest(tenant="globex")),
        (stub.GetInvoice, pb.GetInvoiceRequest(invoice_id=theirs.id)),
        (stub.ListInvoices, pb.ListInvoicesRequest(tenant="globex")),
        (stub.CreateInvoice, pb.CreateInvoiceRequest(tenant="globex", period=PAST)),
        (stub.GetChargebackReport, pb.GetChargebackReportRequest(period=PAST, tenant="globex")),
        (stub.FinalizeInvoice, pb.FinalizeInvoiceRequest(invoice_id=theirs.id)),
    ]
    for method, request in denied:
        error = failed(method, request, keys.acme)
        assert error.code() == U.PERMISSION_DENIED, method
        assert reason(error) == "PERMISSION_DENIED"
    own = stub.QueryUsage(pb.QueryUsageRequest(), metadata=bearer(keys.acme))
    assert [r.call_id for r in own.records] == ["a1"]
    assert stub.ListInvoices(pb.ListInvoicesRequest(), metadata=bearer(keys.acme)).invoices == []
    everyone = stub.QueryUsage(pb.QueryUsageRequest(), metadata=bearer(keys.admin))
    assert [r.call_id for r in everyone.records] == ["a1", "g1"]


# --- RecordUsage ---------------------------------------------------------------------------------------------


def test_a_record_replayed_1000_times_is_stored_once(stub, keys: Keys, ledger: Ledger) -> None:
    request = pb.RecordUsageRequest(records=[record("once")])
    statuses = []
    for _ in range(10):  # waves of concurrent replays: the first insert races the others
        calls = [stub.RecordUsage.future(request, metadata=bearer(keys.admin), timeout=60) for _ in range(100)]
        statuses += [call.result().records[0].status for call in calls]
    assert statuses.count(pb.RECORD_STATUS_ACCEPTED) == 1
    assert statuses.count(pb.RECORD_STATUS_DUPLICATE) == 999
    assert stored_rows(ledger, "once") == 1


def test_same_id_with_another_payload_is_a_loud_conflict(stub, keys: Keys, ledger: Ledger) -> None:
    assert send(stub, keys.admin, record("r1")).records[0].status == pb.RECORD_STATUS_ACCEPTED
    with capture_logs() as logs:
        result = send(stub, keys.admin, record("r1", unit_us=999)).records[0]
    assert (result.id, result.status) == ("r1", pb.RECORD_STATUS_CONFLICT)
    assert any(
        e["event"] == "metering.conflict" and e["log_level"] == "error" and e["record_ids"] == ["r1"] for e in logs
    )
    with ledger.sessions() as session:
        assert session.scalar(select(UsageRow.unit_us).where(UsageRow.call_id == "r1")) == 1_000_000
        assert session.scalar(select(func.count()).select_from(UsageConflict)) == 1
    assert send(stub, keys.admin, record("r1")).records[0].status == pb.RECORD_STATUS_DUPLICATE


def test_an_invalid_record_is_refused_alone_naming_its_field(stub, keys: Keys, ledger: Ledger) -> None:
    bad_unit = record("bad-unit")
    bad_unit.unit = "sm_us"  # a CPU record billed in SM·µs
    no_id = record("x")
    no_id.call_id = ""
    late = record("bad-time")
    late.dispatched_at_us = late.received_at_us - 1
    batch = [record("ok-1"), bad_unit, no_id, record("stranger", tenant="initech"), late, record("ok-2")]
    good_idle = idle_to_pb(idle("cpu:host-a", 0, 1_000))
    bad_idle = idle_to_pb(idle("cpu:host-a", 1, 1_000))
    bad_idle.idle_unit_us = bad_idle.wall_unit_us + 1
    response = send(stub, keys.admin, *batch, idle_records=[good_idle, bad_idle])
    assert [(r.id, pb.RecordStatus.Name(r.status)) for r in response.records] == [
        ("ok-1", "RECORD_STATUS_ACCEPTED"),
        ("bad-unit", "RECORD_STATUS_INVALID"),
        ("", "RECORD_STATUS_INVALID"),
        ("stranger", "RECORD_STATUS_INVALID"),
        ("bad-time", "RECORD_STATUS_INVALID"),
        ("ok-2", "RECORD_STATUS_ACCEPTED"),
    ]
    messages = [r.message for r in response.records]
    assert messages[1].startswith("unit ") and messages[2].startswith("call_id ")
    assert messages[3].startswith("tenant:") and "initech" in messages[3]
    assert messages[4].startswith("dispatched_at_us") and messages[0] == messages[5] == ""
    assert [pb.RecordStatus.Name(r.status) for r in response.idle] == [
        "RECORD_STATUS_ACCEPTED",
        "RECORD_STATUS_INVALID",
    ]
    assert response.idle[1].message.startswith("idle_unit_us")
    assert stored_rows(ledger) == 2


@pytest.mark.parametrize("kind", list(RequestKind))
def test_the_request_kind_survives_the_wire_and_a_sender_before_kinds_sends_plain(kind: RequestKind) -> None:
    message = record("r1", request_kind=kind)
    assert message.request_kind == kind.value
    assert usage_from_pb(pb.UsageRecord.FromString(message.SerializeToString())) == usage("r1", request_kind=kind)
    message.ClearField("request_kind")  # as a replica before kinds sends it
    assert usage_from_pb(message).request_kind is RequestKind.PLAIN


def test_the_ledger_keeps_the_kind_refuses_an_unknown_one_and_another_kind_is_a_conflict(
    stub, keys: Keys, ledger: Ledger
) -> None:
    voice = record("k-voice")
    voice.request_kind = "voice"
    response = send(stub, keys.admin, record("k-chat", request_kind="chat"), record("k-plain"), voice)
    assert [pb.RecordStatus.Name(r.status) for r in response.records] == [
        "RECORD_STATUS_ACCEPTED",
        "RECORD_STATUS_ACCEPTED",
        "RECORD_STATUS_INVALID",
    ]
    assert response.records[2].message.startswith("request_kind ") and "voice" in response.records[2].message
    stored = stub.QueryUsage(pb.QueryUsageRequest(), metadata=bearer(keys.admin)).records
    assert [(r.call_id, r.request_kind) for r in stored] == [("k-chat", "chat"), ("k-plain", "plain")]
    replays = send(stub, keys.admin, record("k-chat", request_kind="chat"), record("k-chat"), record("k-plain"))
    assert [pb.RecordStatus.Name(r.status) for r in replays.records] == [
        "RECORD_STATUS_DUPLICATE",
        "RECORD_STATUS_CONFLICT",  # the same call, now claiming to be plain
        "RECORD_STATUS_DUPLICATE",
    ]
    assert stored_rows(ledger) == 2


def test_an_oversized_batch_is_invalid_argument(stub, keys: Keys) -> None:
    one = record("r")
    error = failed(stub.RecordUsage, pb.RecordUsageRequest(records=[one] * 10_001), keys.admin)
    assert error.code() == U.INVALID_ARGUMENT and bad_field(error) == "records"


# --- QueryUsage ----------------------------------------------------------------------------------------------


def test_query_usage_pages_and_filters(stub, keys: Keys, ledger: Ledger) -> None:
    base = PAST_START_US + 1_000_000
    records = [
        usage(
            f"r{i:02d}",
            finished_at_us=base + i,
            model="tiny" if i % 3 else "big",
            tenant="globex" if i % 5 == 4 else "acme",
            labels={"cost_center": f"cc-{i % 2}", "team": "search", "env": "prod" if i < 20 else "dev"},
        )
        for i in range(25)
    ]
    with unit_of_work(ledger.sessions) as session:
        ingest_usage(session, records)
    query = pb.QueryUsageRequest(page_size=10, start_us=base, end_us=base + 100)
    pages, token = [], ""
    while True:
        query.page_token = token
        page = stub.QueryUsage(query, metadata=bearer(keys.admin))
        pages.append([r.call_id for r in page.records])
        token = page.next_page_token
        if not token:
            break
    assert [len(p) for p in pages] == [10, 10, 5]
    assert sum(pages, []) == [r.call_id for r in records]
    assert stub.QueryUsage(query, metadata=bearer(keys.admin)).records[0] == usage_to_pb(records[20])

    def ids(key: str = keys.admin, **fields) -> list[str]:  # type: ignore[no-untyped-def]
        reply = stub.QueryUsage(pb.QueryUsageRequest(page_size=1000, **fields), metadata=bearer(key))
        return [r.call_id for r in reply.records]

    assert ids(labels={"cost_center": "cc-1", "env": "dev"}) == ["r21", "r23"]
    assert ids(model="big", tenant="acme") == ["r00", "r03", "r06", "r12", "r15", "r18", "r21"]
    assert ids(start_us=base + 5, end_us=base + 8) == ["r05", "r06", "r07"]
    assert ids(keys.globex) == ["r04", "r09", "r14", "r19", "r24"]
    assert ids(keys.acme, model="big", labels={"env": "dev"}) == ["r21"]


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"page_size": 5000}, "page_size"),
        ({"start_us": 10, "end_us": 5}, "end_us"),
        ({"page_token": "bm90LWEtdG9rZW4"}, "page_token"),
        ({"labels": {"Bad Key": "x"}}, "labels.Bad Key"),
    ],
)
def test_query_usage_names_the_bad_field(stub, keys: Keys, fields: dict, field: str) -> None:
    error = failed(stub.QueryUsage, pb.QueryUsageRequest(**fields), keys.admin)
    assert error.code() == U.INVALID_ARGUMENT and bad_field(error) == field


def test_a_page_token_is_tied_to_its_filters(stub, keys: Keys, ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        ingest_usage(session, [usage(f"r{i}", finished_at_us=PAST_START_US + i) for i in range(3)])
    token = stub.QueryUsage(pb.QueryUsageRequest(page_size=1), metadata=bearer(keys.admin)).next_page_token
    error = failed(stub.QueryUsage, pb.QueryUsageRequest(page_size=1, page_token=token, model="tiny"), keys.admin)
    assert error.code() == U.INVALID_ARGUMENT and bad_field(error) == "page_token"


# --- invoices ------------------------------------------------------------------------------------------------


def test_invoice_lifecycle(stub, keys: Keys) -> None:
    send(
        stub,
        keys.admin,
        record("r1", finished_at_us=PAST_START_US + 10, unit_us=1_000_000),
        record("r2", finished_at_us=PAST_START_US + 20, unit_us=2_000_000, request_kind="chat"),
        usage_to_pb(missed("r3", finished_at_us=PAST_START_US + 30, unit_us=1_000_001)),
    )
    draft = stub.CreateInvoice(pb.CreateInvoiceRequest(period=PAST), metadata=bearer(keys.acme))
    assert (draft.tenant, draft.period, draft.status, draft.currency) == ("acme", PAST, pb.INVOICE_STATUS_DRAFT, "USD")
    assert [(line.kind, line.quantity_unit_us, line.requests, line.amount_micros) for line in draft.lines] == [
        ("usage", 4_000_001, 3, 6_000),
        ("sla_credit", 1_000_001, 1, -1_500),
    ]
    assert draft.total_micros == sum(line.amount_micros for line in draft.lines) == draft.balance_micros == 4_500
    assert [
        [(k.request_kind, k.requests, k.quantity_unit_us, k.amount_micros) for k in line.request_kinds]
        for line in draft.lines
    ] == [[("plain", 2, 2_000_001, 3_000), ("chat", 1, 2_000_000, 3_000)], [("plain", 1, 1_000_001, -1_500)]]
    again = stub.CreateInvoice(pb.CreateInvoiceRequest(tenant="acme", period=PAST), metadata=bearer(keys.admin))
    assert again.id == draft.id
    assert [
        i.id for i in stub.ListInvoices(pb.ListInvoicesRequest(period=PAST), metadata=bearer(keys.acme)).invoices
    ] == [draft.id]

    final = stub.FinalizeInvoice(pb.FinalizeInvoiceRequest(invoice_id=draft.id), metadata=bearer(keys.admin))
    assert final.status == pb.INVOICE_STATUS_FINALIZED and final.finalized_at_us > 0
    assert final.total_micros == 4_500
    send(stub, keys.admin, record("late", finished_at_us=PAST_START_US + 40))
    for method, request, key in (
        (stub.CreateInvoice, pb.CreateInvoiceRequest(period=PAST), keys.acme),
        (stub.FinalizeInvoice, pb.FinalizeInvoiceRequest(invoice_id=draft.id), keys.admin),
    ):
        error = failed(method, request, key)
        assert error.code() == U.FAILED_PRECONDITION and reason(error) == "INVOICE_FINALIZED"
    assert stub.GetInvoice(pb.GetInvoiceRequest(invoice_id=draft.id), metadata=bearer(keys.acme)) == final


def test_invoice_requests_name_their_bad_field(stub, keys: Keys) -> None:
    cases = [
        (stub.CreateInvoice, pb.CreateInvoiceRequest(period="2021-13"), keys.acme, U.INVALID_ARGUMENT, "period"),
        (stub.CreateInvoice, pb.CreateInvoiceRequest(period=PAST), keys.admin, U.INVALID_ARGUMENT, "tenant"),
        (stub.GetInvoice, pb.GetInvoiceRequest(), keys.acme, U.INVALID_ARGUMENT, "invoice_id"),
    ]
    for method, request, key, code, field in cases:
        error = failed(method, request, key)
        assert (error.code(), bad_field(error)) == (code, field)
    assert failed(stub.GetInvoice, pb.GetInvoiceRequest(invoice_id=404), keys.admin).code() == U.NOT_FOUND
    error = failed(stub.CreateInvoice, pb.CreateInvoiceRequest(tenant="initech", period=PAST), keys.admin)
    assert error.code() == U.NOT_FOUND and reason(error) == "UNKNOWN_TENANT"


def test_a_month_that_has_not_ended_cannot_be_finalized(stub, keys: Keys) -> None:
    draft = stub.CreateInvoice(pb.CreateInvoiceRequest(period="2999-01"), metadata=bearer(keys.acme))
    error = failed(stub.FinalizeInvoice, pb.FinalizeInvoiceRequest(invoice_id=draft.id), keys.admin)
    assert error.code() == U.FAILED_PRECONDITION and reason(error) == "INVOICE_STATE"


# --- chargeback ----------------------------------------------------------------------------------------------


def test_chargeback_report(stub, keys: Keys) -> None:
    send(
        stub,
        keys.admin,
        record("a1", finished_at_us=PAST_START_US + 10),
        record(
            "a2",
            finished_at_us=PAST_START_US + 20,
            labels={"cost_center": "cc-2"},
            unit_us=2_000_000,
            request_kind="chat",
        ),
        usage_to_pb(missed("a3", finished_at_us=PAST_START_US + 30)),
        record("g1", tenant="globex", finished_at_us=PAST_START_US + 40),
        idle_records=[idle_to_pb(idle("cpu:host-a", 0, 200_000_000, start_us=PAST_START_US))],
    )
    report = stub.GetChargebackReport(
        pb.GetChargebackReportRequest(period=PAST, group_by=["cost_center", "tenant"]), metadata=bearer(keys.admin)
    )
    assert (report.period, list(report.group_by), report.currency) == (PAST, ["cost_center", "tenant"], "USD")
    assert [(dict(r.group), r.requests, r.admitted, r.deadline_met, r.unit_us, r.cost_micros) for r in report.rows] == [
        ({"cost_center": "cc-1", "tenant": "acme"}, 2, 2, 1, 2_000_000, 1_500),
        ({"cost_center": "cc-1", "tenant": "globex"}, 1, 1, 1, 1_000_000, 1_500),
        ({"cost_center": "cc-2", "tenant": "acme"}, 1, 1, 1, 2_000_000, 3_000),
    ]
    assert [(d.device_id, d.wall_unit_us, d.idle_unit_us, d.billed_unit_us) for d in report.devices] == [
        ("cpu:host-a", 240_000_000, 200_000_000, 5_000_000)
    ]
    own = stub.GetChargebackReport(
        pb.GetChargebackReportRequest(period=PAST, group_by=["tenant"]), metadata=bearer(keys.acme)
    )
    assert [(dict(r.group), r.requests) for r in own.rows] == [({"tenant": "acme"}, 3)]
    kinds = stub.GetChargebackReport(
        pb.GetChargebackReportRequest(period=PAST, group_by=["request_kind"]), metadata=bearer(keys.admin)
    )
    assert [(dict(r.group), r.requests, r.unit_us, r.cost_micros) for r in kinds.rows] == [
        ({"request_kind": "chat"}, 1, 2_000_000, 3_000),
        ({"request_kind": "plain"}, 3, 3_000_000, 3_000),  # a3's miss credited
    ]
    assert list(own.devices) == []  # shared infrastructure is not a tenant's to see
    error = failed(
        stub.GetChargebackReport, pb.GetChargebackReportRequest(period=PAST, group_by=["colour"]), keys.admin
    )
    assert error.code() == U.INVALID_ARGUMENT and bad_field(error) == "group_by"


# --- the process around it -----------------------------------------------------------------------------------


def test_health_and_reflection(metering) -> None:  # type: ignore[no-untyped-def]
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with metering.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "zeroqueue.metering.v1.Metering", "liveness"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert "zeroqueue.metering.v1.Metering" in names and "grpc.health.v1.Health" in names
