"""The price book and the once-per-line rounding rule."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from billing.db import unit_of_work
from billing.errors import InvalidPrice, MissingPrice, PriceExists
from billing.invoices import create_or_refresh_draft
from billing.ledger import ingest_usage
from billing.models import LineKind
from billing.pricing import add_price, cost_micros, price_at, price_history
from billing.tenants import create_tenant
from tests.billing.conftest import Ledger
from tests.billing.factories import PERIOD, START_US, missed, usage


@pytest.mark.parametrize(
    ("unit_us", "price_micros", "expected"),
    [
        (1_000_000, 1_500, 1_500),  # one core·second
        (1, 500_000, 1),  # exactly half a micro rounds up
        (1, 499_999, 0),
        (3, 500_000, 2),  # 1.5 → 2
        (0, 10**9, 0),
        (2**63 - 1, 2**63 - 1, ((2**63 - 1) ** 2 + 500_000) // 1_000_000),  # no overflow, no float
    ],
)
def test_cost_micros_rounds_half_up(unit_us: int, price_micros: int, expected: int) -> None:
    assert cost_micros(unit_us, price_micros) == expected


@given(st.integers(0, 2**63 - 1), st.integers(0, 2**40))
def test_cost_micros_matches_exact_rational_rounding(unit_us: int, price_micros: int) -> None:
    exact = Fraction(unit_us * price_micros, 1_000_000)
    assert cost_micros(unit_us, price_micros) == int(exact + Fraction(1, 2))  # floor(x + ½)


def test_price_versions_are_added_never_edited(ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        first = add_price(session, "tiny", "core_us", 100, "USD", START_US)
        second = add_price(session, "tiny", "core_us", 120, "USD", START_US + 1_000)
        add_price(session, "tiny", "sm_us", 5, "USD", 0)
    with ledger.sessions() as session:
        assert price_at(session, "tiny", "core_us", START_US) == first
        assert price_at(session, "tiny", "core_us", START_US + 999) == first
        assert price_at(session, "tiny", "core_us", START_US + 1_000) == second  # inclusive start
        with pytest.raises(MissingPrice) as missing:
            price_at(session, "tiny", "core_us", START_US - 1)
        assert missing.value.field == "model"
        assert [v.price_micros for v in price_history(session, "tiny", "core_us")] == [100, 120]
    with pytest.raises(PriceExists) as clash, unit_of_work(ledger.sessions) as session:
        add_price(session, "tiny", "core_us", 999, "USD", START_US)
    assert clash.value.field == "effective_from_us"


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("tiny", "core_us", -1, "USD", 0), "price_micros"),
        (("tiny", "core_us", 1.5, "USD", 0), "price_micros"),
        (("tiny", "gpu_s", 1, "USD", 0), "unit"),
        (("tiny", "core_us", 1, "usd", 0), "currency"),
        (("", "core_us", 1, "USD", 0), "model"),
    ],
)
def test_invalid_prices_name_the_field(ledger: Ledger, args: tuple, field: str) -> None:
    with ledger.sessions() as session, pytest.raises(InvalidPrice) as caught:
        add_price(session, *args)
    assert caught.value.field == field


_tenants = itertools.count()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    price_micros=st.integers(0, 3_000_000),
    parts=st.lists(st.tuples(st.integers(0, 5_000_000), st.booleans()), min_size=1, max_size=12),
)
def test_an_invoice_line_rounds_the_sum_once_not_each_request(ledger: Ledger, price_micros, parts) -> None:
    tenant = model = f"t{next(_tenants)}"  # examples share the database: fresh names each time
    records = [
        (missed if was_missed else usage)(f"{tenant}-{i}", tenant=tenant, model=model, unit_us=unit_us)
        for i, (unit_us, was_missed) in enumerate(parts)
    ]
    with unit_of_work(ledger.sessions) as session:
        add_price(session, model, "core_us", 1_000, "USD", 0)  # superseded before the period
        add_price(session, model, "core_us", price_micros, "USD", START_US)
        price = price_micros
        create_tenant(session, tenant)
        ingest_usage(session, records)
        invoice = create_or_refresh_draft(session, tenant, PERIOD)
    total_unit_us = sum(unit_us for unit_us, _ in parts)
    missed_unit_us = sum(unit_us for unit_us, was_missed in parts if was_missed)
    amounts = {line.kind: line.amount_micros for line in invoice.lines}
    assert amounts[LineKind.USAGE] == cost_micros(total_unit_us, price)
    assert amounts.get(LineKind.SLA_CREDIT, 0) == -cost_micros(missed_unit_us, price)
    assert invoice.total_micros == sum(amounts.values())
