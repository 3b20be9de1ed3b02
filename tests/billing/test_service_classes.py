"""Classes of service and tenant policies: validation naming the field, the rules the database keeps."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import text

from billing.db import ledger_errors, unit_of_work
from billing.errors import (
    ClassExists,
    ClassRuleFixed,
    InvalidClass,
    InvalidPolicy,
    InvalidRecord,
    LedgerRefused,
    UnknownClass,
    UnknownTenant,
)
from billing.models import DEFAULT_CLASS, MAX_CLASS_BUDGET_MS, PPM
from billing.policy import STANDARD, ClassSpec
from billing.records import DEFAULT_CLASS as RECORDS_DEFAULT_CLASS
from billing.service_classes import (
    KEEP,
    add_class,
    get_class,
    list_classes,
    set_tenant_policy,
    show_tenant_policy,
    update_class,
)
from billing.tenants import create_tenant
from tests.billing.conftest import Ledger


@pytest.fixture
def classes(ledger: Ledger) -> Ledger:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
        add_class(session, "interactive", min_budget_ms=1, max_budget_ms=2_000, priority=50, credit_ppm=PPM)
        add_class(session, "batch", min_budget_ms=1_000, priority=0, credit_ppm=100_000)
    return ledger


def test_the_ledger_starts_with_standard_and_keeps_added_classes(classes: Ledger) -> None:
    assert DEFAULT_CLASS == RECORDS_DEFAULT_CLASS == STANDARD.name
    with classes.sessions() as session:
        assert list_classes(session) == [
            ClassSpec("batch", 1_000, MAX_CLASS_BUDGET_MS, 0, 100_000),
            ClassSpec("interactive", 1, 2_000, 50, PPM),
            STANDARD,
        ]
        assert get_class(session, "interactive").priority == 50


@pytest.mark.parametrize(
    ("fields", "error", "field"),
    [
        ({"name": ""}, InvalidClass, "name"),
        ({"name": "Batch"}, InvalidClass, "name"),
        ({"name": "a" * 33}, InvalidClass, "name"),
        ({"name": "has space"}, InvalidClass, "name"),
        ({"name": "batch"}, ClassExists, "name"),
        ({"min_budget_ms": 0}, InvalidClass, "min_budget_ms"),
        ({"max_budget_ms": MAX_CLASS_BUDGET_MS + 1}, InvalidClass, "max_budget_ms"),
        ({"min_budget_ms": 10, "max_budget_ms": 9}, InvalidClass, "max_budget_ms"),
        ({"priority": 101}, InvalidClass, "priority"),
        ({"priority": -1}, InvalidClass, "priority"),
        ({"credit_ppm": PPM + 1}, InvalidClass, "credit_ppm"),
        ({"credit_ppm": True}, InvalidClass, "credit_ppm"),
    ],
)
def test_add_class_refuses_naming_the_field(classes: Ledger, fields: dict, error: type, field: str) -> None:
    arguments = {"name": "new", "credit_ppm": 0} | fields
    with pytest.raises(error) as caught, unit_of_work(classes.sessions) as session:
        add_class(session, **arguments)
    assert caught.value.field == field


def test_a_class_changes_budgets_and_priority_never_its_credit_rule(classes: Ledger) -> None:
    with unit_of_work(classes.sessions) as session:
        assert update_class(session, "batch", max_budget_ms=60_000, priority=10) == ClassSpec(
            "batch", 1_000, 60_000, 10, 100_000
        )
        assert update_class(session, "batch", credit_ppm=100_000).credit_ppm == 100_000  # the same rule: no change
    with pytest.raises(ClassRuleFixed) as caught, unit_of_work(classes.sessions) as session:
        update_class(session, "batch", credit_ppm=PPM)
    assert caught.value.field == "credit_ppm" and "new class" in caught.value.message
    with pytest.raises(InvalidClass) as caught, unit_of_work(classes.sessions) as session:
        update_class(session, "batch", min_budget_ms=70_000)  # above the stored max
    assert caught.value.field == "max_budget_ms"
    with pytest.raises(UnknownClass) as caught, unit_of_work(classes.sessions) as session:
        update_class(session, "nope", priority=1)
    assert caught.value.field == "name"
    with classes.sessions() as session:
        assert get_class(session, "batch") == ClassSpec("batch", 1_000, 60_000, 10, 100_000)


@pytest.mark.parametrize(
    "statement",
    [
        "DELETE FROM service_classes WHERE name = 'batch'",
        "UPDATE service_classes SET credit_ppm = 1000000 WHERE name = 'batch'",
        "UPDATE service_classes SET name = 'cheap' WHERE name = 'batch'",
        "DELETE FROM service_classes WHERE name = 'standard'",
    ],
)
def test_the_database_refuses_deleting_a_class_or_changing_its_rule(classes: Ledger, statement: str) -> None:
    with pytest.raises(LedgerRefused, match="service_classes"), ledger_errors(), classes.engine.begin() as connection:
        connection.execute(text(statement))
    with classes.engine.begin() as connection:  # budgets and priority may change, whoever writes
        connection.execute(text("UPDATE service_classes SET priority = 7 WHERE name = 'batch'"))
    with classes.sessions() as session:
        assert get_class(session, "batch").priority == 7 and get_class(session, "batch").credit_ppm == 100_000


def test_a_tenant_policy_is_set_kept_and_cleared(classes: Ledger) -> None:
    with classes.sessions() as session:
        assert show_tenant_policy(session, "acme").weight == 1  # no row: weight 1, no caps
        assert show_tenant_policy(session, "acme").updated_at_us is None
    with unit_of_work(classes.sessions) as session:
        view = set_tenant_policy(session, "acme", weight=5, device_us_per_month=10**9, calls_per_s=20, now_us=7)
        assert (view.weight, view.device_us_per_month, view.spend_micros_per_month, view.calls_per_s) == (
            5,
            10**9,
            None,
            20,
        )
    with unit_of_work(classes.sessions) as session:
        view = set_tenant_policy(session, "acme", spend_micros_per_month=5_000_000, calls_per_s=None, now_us=8)
    with classes.sessions() as session:
        shown = show_tenant_policy(session, "acme")
    assert shown == view
    assert (shown.weight, shown.device_us_per_month, shown.spend_micros_per_month, shown.calls_per_s) == (
        5,
        10**9,
        5_000_000,
        None,
    )
    assert shown.updated_at_us == 8 and KEEP is not None


@pytest.mark.parametrize(
    ("fields", "error", "field"),
    [
        ({"weight": 0}, InvalidPolicy, "weight"),
        ({"weight": 1001}, InvalidPolicy, "weight"),
        ({"device_us_per_month": 0}, InvalidPolicy, "device_us_per_month"),
        ({"spend_micros_per_month": -5}, InvalidPolicy, "spend_micros_per_month"),
        ({"calls_per_s": 2**31}, InvalidPolicy, "calls_per_s"),
        ({"calls_per_s": 1.5}, InvalidPolicy, "calls_per_s"),
        ({"tenant": "nobody"}, UnknownTenant, "tenant"),
        ({"tenant": "Not A Name"}, InvalidRecord, "tenant"),
    ],
)
def test_set_tenant_policy_refuses_naming_the_field(classes: Ledger, fields: dict, error: type, field: str) -> None:
    arguments = {"tenant": "acme"} | fields
    with pytest.raises(error) as caught, unit_of_work(classes.sessions) as session:
        set_tenant_policy(session, **arguments)
    assert caught.value.field == field
    with classes.sessions() as session:
        assert show_tenant_policy(session, "acme").updated_at_us is None  # nothing was written


@pytest.mark.postgres
@pytest.mark.parametrize("ledger", ["postgresql"], indirect=True)
def test_two_first_settings_at_once_both_land(classes: Ledger) -> None:
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def set_one(**cap: int) -> None:
        try:
            with unit_of_work(classes.sessions) as session:
                start.wait()
                set_tenant_policy(session, "acme", **cap)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [
        threading.Thread(target=set_one, kwargs={"calls_per_s": 9}),
        threading.Thread(target=set_one, kwargs={"device_us_per_month": 77}),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    with classes.sessions() as session:
        shown = show_tenant_policy(session, "acme")
    assert (shown.weight, shown.calls_per_s, shown.device_us_per_month) == (1, 9, 77)
