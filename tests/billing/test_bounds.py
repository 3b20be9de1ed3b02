"""What a record, a period and a sum may be, and how the database's refusals read (on SQLite and PostgreSQL)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.exc import SQLAlchemyError

from billing.chargeback import chargeback_report
from billing.db import ledger_error, ledger_errors, unit_of_work
from billing.errors import AmountOutOfRange, DataRejected, InvalidPeriod, InvalidRecord, LedgerUnavailable
from billing.invoices import create_or_refresh_draft, list_invoices
from billing.ledger import ingest_usage
from billing.models import Invoice, Tenant, UsageRow
from billing.period import parse_period
from billing.pricing import add_price
from billing.records import MAX_INT64, MAX_NUM_UNITS, MAX_RECORD_WALL_US, MAX_TIME_US, MAX_TOKENS
from billing.tenants import create_tenant
from tests.billing.conftest import Ledger
from tests.billing.factories import PERIOD, START_US, gpu_usage, idle, usage

UNICODE_PERIODS = ["２０２６-１０", "٢٠٢٦-١٠", "२०२६-१०", "2026-１0", "2026-10\n", "2026-1O"]


@pytest.mark.parametrize("period", UNICODE_PERIODS)
def test_a_period_is_ascii_digits_only(period: str) -> None:
    with pytest.raises(InvalidPeriod) as caught:
        parse_period(period)
    assert caught.value.field == "period"


def test_a_period_has_one_spelling() -> None:
    assert parse_period("2026-10").name == "2026-10"


@pytest.fixture
def acme(ledger: Ledger) -> Ledger:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
        create_tenant(session, "globex")
        add_price(session, "tiny", "core_us", 1_500, "USD", 0)
        add_price(session, "big", "sm_us", 1, "USD", 0)
    return ledger


def test_one_month_has_one_invoice_whatever_the_digits(acme: Ledger) -> None:
    with unit_of_work(acme.sessions) as session:
        draft = create_or_refresh_draft(session, "acme", PERIOD)
        for period in UNICODE_PERIODS:
            with pytest.raises(InvalidPeriod):
                create_or_refresh_draft(session, "acme", period)
        assert [i.id for i in list_invoices(session, tenant="acme")] == [draft.id]
        assert session.scalars(select(Invoice.period)).all() == [PERIOD]


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"unit_us": 4 * MAX_RECORD_WALL_US + 1}, "unit_us"),  # more than a month on all 4 units
        ({"unit_us": MAX_INT64}, "unit_us"),
        ({"num_units": MAX_NUM_UNITS + 1}, "num_units"),
        ({"prompt_tokens": MAX_TOKENS + 1}, "prompt_tokens"),
        ({"completion_tokens": 2**62}, "completion_tokens"),
        ({"finished_at_us": MAX_TIME_US, "deadline_at_us": MAX_TIME_US}, "finished_at_us"),
        ({"received_at_us": 0}, "received_at_us"),
    ],
)
def test_a_record_that_could_overflow_a_month_is_refused_naming_its_field(overrides: dict, field: str) -> None:
    with pytest.raises(InvalidRecord) as caught:
        usage("r-1", **overrides)
    assert caught.value.field == field


def test_the_bounds_admit_what_real_devices_do() -> None:
    usage("r-1", unit_us=4 * MAX_RECORD_WALL_US)
    gpu_usage("r-2", num_units=MAX_NUM_UNITS, unit_us=MAX_NUM_UNITS * MAX_RECORD_WALL_US)
    usage("r-3", deadline_at_us=MAX_INT64)  # a deadline is only compared: any positive one will do
    with pytest.raises(InvalidRecord) as caught:
        idle("cpu:host-a", 0, 0, num_units=MAX_NUM_UNITS + 1)
    assert caught.value.field == "num_units"


def maximal(call_id: str, finished_at_us: int) -> object:
    return gpu_usage(
        call_id,
        model="big",
        num_units=MAX_NUM_UNITS,
        unit_us=MAX_NUM_UNITS * MAX_RECORD_WALL_US,
        finished_at_us=finished_at_us,
        labels={"cost_center": "cc-1"},
    )


def test_a_month_of_maximal_records_sums_exactly_and_one_that_overflows_is_refused_by_name(acme: Ledger) -> None:
    per_record = MAX_NUM_UNITS * MAX_RECORD_WALL_US
    fits = MAX_INT64 // per_record  # 840 records: the most an invoice line holds
    october, november = START_US, parse_period("2026-11").start_us
    with unit_of_work(acme.sessions) as session:
        ingest_usage(session, [maximal(f"oct-{i}", october + i) for i in range(fits)])
        ingest_usage(session, [maximal(f"nov-{i}", november + i) for i in range(fits + 1)])
    with unit_of_work(acme.sessions) as session:
        draft = create_or_refresh_draft(session, "acme", PERIOD)
        [line] = draft.lines
        assert (line.num_requests, line.unit_us) == (fits, fits * per_record)  # exact, past 2^53
        assert line.amount_micros == (fits * per_record + 500_000) // 1_000_000
        report = chargeback_report(session, PERIOD, ["tenant"])
        assert [row.unit_us for row in report.rows] == [fits * per_record]
    with unit_of_work(acme.sessions) as session:
        with pytest.raises(AmountOutOfRange, match="2026-11") as caught:
            create_or_refresh_draft(session, "acme", "2026-11")
        assert caught.value.field == "period"
        with pytest.raises(AmountOutOfRange, match="2026-11"):
            chargeback_report(session, "2026-11", ["cost_center"])
        assert create_or_refresh_draft(session, "globex", "2026-11").total_micros == 0  # others are unaffected


# --- the database's refusals as billing errors (billing.db.ledger_errors) ------------------------------------


def test_a_value_the_database_refuses_is_data_rejected_naming_the_field(acme: Ledger) -> None:
    with pytest.raises(DataRejected) as caught, ledger_errors(), unit_of_work(acme.sessions) as session:
        session.add(
            Invoice(
                tenant_id=1,
                period="２０２６-１０",
                status="draft",
                currency="USD",
                total_micros=0,
                period_start_us=0,
                period_end_us=1,
                created_at_us=0,
                refreshed_at_us=0,
            )
        )
        session.flush()
    assert caught.value.field == "period" and "ck_invoices_period_format" in caught.value.message
    with pytest.raises(DataRejected) as caught, ledger_errors(), unit_of_work(acme.sessions) as session:
        ingest_usage(session, [usage("r-1")])
        session.execute(
            text(
                "INSERT INTO usage_records SELECT id + 1, 'r-2', tenant_id, labels, cost_center, team, "
                "model, device_kind, device_id, unit, num_units, unit_us * 100000000, prompt_tokens, "
                "completion_tokens, received_at_us, dispatched_at_us, first_token_at_us, finished_at_us, "
                "deadline_at_us, deadline_met, outcome, payload_digest, ingested_at_us, "
                "request_id, service_class, request_kind, door, cached_prompt_tokens, weight_dtype FROM usage_records"
            )
        )
    assert caught.value.field == "unit_us"
    with acme.sessions() as session:
        assert session.scalar(select(func.count()).select_from(UsageRow)) == 0  # nothing was committed


@pytest.mark.postgres
@pytest.mark.parametrize("ledger", ["postgresql"], indirect=True)  # PostgreSQL's own refusals
def test_postgresql_data_errors_are_data_rejected_and_a_bug_stays_a_bug(acme: Ledger) -> None:
    for query in (select(Invoice).where(Invoice.id == 2**31), select(Tenant).where(Tenant.name == "a\x00b")):
        with pytest.raises(DataRejected), ledger_errors(), acme.sessions() as session:
            session.execute(query)
    with pytest.raises(SQLAlchemyError) as caught, ledger_errors(), acme.sessions() as session:
        session.execute(text("SELECT * FROM no_such_table"))
    assert ledger_error(caught.value) is None


def test_a_database_that_cannot_be_reached_is_unavailable(tmp_path) -> None:
    for url in (
        "postgresql+psycopg://postgres@127.0.0.1:1/test?connect_timeout=2",
        f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'ledger.db'}",
    ):
        engine = create_engine(url)
        try:
            with pytest.raises(LedgerUnavailable), ledger_errors(), engine.connect() as connection:
                connection.execute(text("SELECT 1"))
        finally:
            engine.dispose()
