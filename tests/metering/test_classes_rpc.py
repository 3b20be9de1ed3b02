"""Classes of service through gRPC: records and invoice lines carry their class, and GetServingPolicy, which
only admin keys may call."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from zeroqueue.metering.v1 import metering_pb2 as pb

from billing.db import unit_of_work
from billing.models import PPM
from billing.period import now_us, parse_period, period_of
from billing.pricing import add_price
from billing.service_classes import add_class, set_tenant_policy
from services.metering.policy_wire import SharedRead, policy_from_proto
from services.metering.servicer import usage_to_pb
from tests.billing.conftest import Ledger
from tests.billing.factories import missed, usage
from tests.inference.harness import status_details
from tests.metering.conftest import Keys, bearer, failed

PAST = "2021-03"
PAST_START_US = parse_period(PAST).start_us + 3_600_000_000
U = grpc.StatusCode


@pytest.fixture
def classed(ledger: Ledger, keys: Keys) -> Keys:
    with unit_of_work(ledger.sessions) as session:
        add_class(session, "batch", min_budget_ms=1_000, credit_ppm=100_000)
        add_price(session, "tiny", "core_us", 500, "USD", 0, service_class="batch")
        set_tenant_policy(session, "acme", weight=3, spend_micros_per_month=1_000_000)
    return keys


def test_records_carry_their_class_and_invoice_lines_show_it(stub, classed: Keys) -> None:
    empty = usage_to_pb(usage("r-old", finished_at_us=PAST_START_US))
    empty.service_class = ""  # a sender from before classes
    records = [
        empty,
        usage_to_pb(usage("r-batch", service_class="batch", finished_at_us=PAST_START_US, unit_us=2_000_000)),
        usage_to_pb(missed("r-missed", service_class="batch", finished_at_us=PAST_START_US, unit_us=2_000_000)),
    ]
    admin = bearer(classed.admin)
    reply = stub.RecordUsage(pb.RecordUsageRequest(records=records), metadata=admin, timeout=30)
    assert [r.status for r in reply.records] == [pb.RECORD_STATUS_ACCEPTED] * 3
    bad = usage_to_pb(usage("r-bad", service_class="batch"))
    bad.service_class = "Not A Class"
    reply = stub.RecordUsage(pb.RecordUsageRequest(records=[bad]), metadata=admin, timeout=30)
    assert reply.records[0].status == pb.RECORD_STATUS_INVALID and "service_class" in reply.records[0].message
    page = stub.QueryUsage(pb.QueryUsageRequest(tenant="acme"), metadata=bearer(classed.acme), timeout=30)
    assert {r.call_id: r.service_class for r in page.records} == {
        "r-old": "standard",
        "r-batch": "batch",
        "r-missed": "batch",
    }
    invoice = stub.CreateInvoice(pb.CreateInvoiceRequest(period=PAST), metadata=bearer(classed.acme), timeout=30)
    assert [(line.service_class, line.kind, line.amount_micros) for line in invoice.lines] == [
        ("batch", "usage", 2_000),  # 4 s at batch's own 500
        ("batch", "sla_credit", -100),  # 10 % of the missed 1,000
        ("standard", "usage", 1_500),  # 1 s at the generic 1,500
    ]
    report = stub.GetChargebackReport(
        pb.GetChargebackReportRequest(period=PAST, group_by=["service_class"]), metadata=admin, timeout=30
    )
    assert [(dict(row.group), row.cost_micros) for row in report.rows] == [
        ({"service_class": "batch"}, 1_900),
        ({"service_class": "standard"}, 1_500),
    ]


def test_an_admin_key_reads_the_serving_policy(stub, classed: Keys) -> None:
    finished = now_us() - 1  # this month's use is what the policy counts
    if finished < period_of(now_us()).start_us + 1_000_000:
        pytest.skip("too close to the start of a month")
    record = usage_to_pb(usage("r-now", service_class="batch", finished_at_us=finished, unit_us=2_000_000))
    stub.RecordUsage(pb.RecordUsageRequest(records=[record]), metadata=bearer(classed.admin), timeout=30)
    message = stub.GetServingPolicy(pb.GetServingPolicyRequest(), metadata=bearer(classed.admin), timeout=30)
    policy = policy_from_proto(message)
    assert [spec.name for spec in policy.classes] == ["batch", "standard"]
    assert policy.class_named("batch").credit_ppm == 100_000 and policy.class_named("standard").credit_ppm == PPM
    assert policy.price_of("tiny", "core_us", "batch").price_micros == 500
    assert policy.price_of("tiny", "core_us", "standard").price_micros == 1_500
    acme = policy.tenants["acme"]
    assert (acme.weight, acme.spend_micros_per_month, acme.used_device_us, acme.spent_micros) == (
        3,
        1_000_000,
        2_000_000,
        1_000,
    )
    assert acme.resets_at_us == period_of(policy.read_at_us).end_us and set(policy.tenants) == {"acme"}


@pytest.mark.parametrize(
    ("key", "code"), [("acme", U.PERMISSION_DENIED), ("revoked", U.UNAUTHENTICATED), (None, U.UNAUTHENTICATED)]
)
def test_only_admin_keys_read_the_serving_policy(stub, classed: Keys, key: str | None, code: grpc.StatusCode) -> None:
    error = failed(stub.GetServingPolicy, pb.GetServingPolicyRequest(), getattr(classed, key) if key else None)
    assert error.code() == code
    if code == U.PERMISSION_DENIED:
        assert "GetServingPolicy needs an admin key" in error.details()
        assert status_details(error)["ErrorInfo"].reason == "PERMISSION_DENIED"


def test_one_read_of_the_policy_serves_the_polls_within_its_age() -> None:
    now = [100.0]
    reads: list[int] = []

    async def read() -> pb.ServingPolicy:
        reads.append(1)
        await asyncio.sleep(0.01)
        if len(reads) == 3:
            raise ConnectionError("ledger down")
        return pb.ServingPolicy(read_at_us=len(reads))

    async def scenario() -> None:
        shared = SharedRead(read, max_age_s=1.0, clock=lambda: now[0])
        first = await asyncio.gather(*(shared.get() for _ in range(5)))  # at once: one read
        assert [p.read_at_us for p in first] == [1] * 5 and len(reads) == 1
        now[0] += 1.0
        assert (await shared.get()).read_at_us == 1  # not older than its age yet
        now[0] += 0.5
        assert (await shared.get()).read_at_us == 2
        now[0] += 2
        with pytest.raises(ConnectionError):
            await shared.get()
        assert (await shared.get()).read_at_us == 4  # a failed read is not kept

    asyncio.run(scenario())
