"""`zeroqueue classes …`, `zeroqueue tenants policy …` and `zeroqueue prices add --class`, in this process (one
through its own process too) against a temporary SQLite ledger."""

from __future__ import annotations

from pathlib import Path

import pytest

from billing.db import make_engine, session_factory
from billing.pricing import price_history
from services.cli import main
from services.cli_service_classes import exact_amount
from tests.metering.test_cli import zeroqueue


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    url = f"sqlite+pysqlite:///{tmp_path / 'ledger.db'}"
    assert main(["migrate", "--ledger", url]) == 0
    assert main(["tenants", "create", "acme", "--ledger", url]) == 0
    return url


def run(capsys: pytest.CaptureFixture[str], url: str, *args: str, ok: bool = True) -> str:
    capsys.readouterr()
    code = main([*args, "--ledger", url])
    out, err = capsys.readouterr()
    assert (code == 0) == ok, (code, out, err)
    if not ok:
        assert err.startswith("zeroqueue: error: ") and len(err.strip().splitlines()) == 1, err
        return err
    return out


def rows(out: str) -> list[list[str]]:
    return [line.split("\t") for line in out.strip().splitlines()]


def test_classes_are_added_updated_and_listed(capsys: pytest.CaptureFixture[str], ledger_url: str) -> None:
    added = run(capsys, ledger_url, "classes", "add", "batch", "--min-budget-ms", "1000", "--credit-ppm", "100000")
    assert rows(added)[1] == ["batch", "1000", "86400000", "0", "100000"]
    interactive = ("interactive", "--max-budget-ms", "2000", "--priority", "50", "--credit-ppm", "1000000")
    run(capsys, ledger_url, "class", "add", *interactive)
    updated = run(capsys, ledger_url, "classes", "update", "batch", "--priority", "5", "--max-budget-ms", "60000")
    assert rows(updated)[1] == ["batch", "1000", "60000", "5", "100000"]
    listed = rows(run(capsys, ledger_url, "classes", "list"))
    assert listed[0] == ["name", "min_budget_ms", "max_budget_ms", "priority", "credit_ppm"]
    assert [row[0] for row in listed[1:]] == ["batch", "interactive", "standard"]
    for args, message in (
        (("classes", "update", "batch", "--credit-ppm", "0"), "credit_ppm: class 'batch' credits 100000 ppm"),
        (("classes", "add", "Batch", "--credit-ppm", "0"), "name must be 1..32 characters of [a-z0-9_-]"),
        (("classes", "add", "batch", "--credit-ppm", "0"), "already exists"),
        (("classes", "add", "x", "--credit-ppm", "1000001"), "credit_ppm must be an integer in [0, 1000000]"),
        (("classes", "add", "x", "--priority", "101", "--credit-ppm", "0"), "priority must be an integer"),
        (("classes", "update", "nope", "--priority", "1"), "no class of service named 'nope'"),
    ):
        assert message in run(capsys, ledger_url, *args, ok=False)


def test_prices_add_for_a_class(capsys: pytest.CaptureFixture[str], ledger_url: str) -> None:
    run(capsys, ledger_url, "classes", "add", "batch", "--credit-ppm", "100000")
    common = ("prices", "add", "--model", "tiny", "--unit", "core_us", "--effective-from", "2026-01-01T00:00:00Z")
    out = run(capsys, ledger_url, *common, "--price-micros", "1000", "--class", "batch")
    assert "for class batch" in out
    assert "for every class without its own" in run(capsys, ledger_url, *common, "--price-micros", "2000")
    assert "no class of service named 'ghost'" in run(
        capsys, ledger_url, *common, "--price-micros", "1", "--class", "ghost", ok=False
    )
    assert "already exists" in run(capsys, ledger_url, *common, "--price-micros", "1", "--class", "batch", ok=False)
    engine = make_engine(ledger_url)
    try:
        with session_factory(engine)() as session:
            history = [(v.service_class, v.price_micros) for v in price_history(session)]
        assert history == [("", 2_000), ("batch", 1_000)]
    finally:
        engine.dispose()


def test_a_tenant_policy_is_set_shown_and_cleared(capsys: pytest.CaptureFixture[str], ledger_url: str) -> None:
    assert rows(run(capsys, ledger_url, "tenants", "policy", "show", "acme")) == [
        ["tenant", "acme"],
        ["weight", "1"],
        ["device_us_per_month", "none"],
        ["spend_micros_per_month", "none"],
        ["calls_per_s", "none"],
    ]
    out = run(
        capsys,
        ledger_url,
        *("tenants", "policy", "set", "acme", "--weight", "5", "--device-hours-per-month", "1.5"),
        *("--spend-per-month", "12.50", "--calls-per-s", "20"),
    )
    assert dict(rows(out)) == {
        "tenant": "acme",
        "weight": "5",
        "device_us_per_month": "5400000000",
        "spend_micros_per_month": "12500000",
        "calls_per_s": "20",
    }
    run(capsys, ledger_url, "tenants", "policy", "set", "acme", "--clear", "calls", "--spend-micros-per-month", "7")
    shown = dict(rows(run(capsys, ledger_url, "tenants", "policy", "show", "acme")))
    assert (shown["weight"], shown["spend_micros_per_month"], shown["calls_per_s"]) == ("5", "7", "none")
    run(capsys, ledger_url, "tenants", "policy", "set", "acme", "--clear", "device_us_per_month")
    assert dict(rows(run(capsys, ledger_url, "tenants", "policy", "show", "acme")))["device_us_per_month"] == "none"
    for args, message in (
        (("--weight", "0"), "weight must be an integer in [1, 1000]"),
        (("--calls-per-s", "0"), "calls_per_s must be an integer in [1, 2147483647]"),
        (("--spend-per-month", "0.0000001"), "--spend-per-month must be positive and exact to a millionth"),
        (("--device-hours-per-month", "lots"), "--device-hours-per-month must be a decimal number"),
        (("--clear", "spend", "--spend-per-month", "1"), "--clear: spend_micros_per_month is both set and cleared"),
    ):
        assert message in run(capsys, ledger_url, "tenants", "policy", "set", "acme", *args, ok=False)
    assert "no tenant named 'nobody'" in run(capsys, ledger_url, "tenants", "policy", "show", "nobody", ok=False)


@pytest.mark.parametrize(
    ("text", "scale", "expected"),
    [("1.5", 3_600_000_000, 5_400_000_000), ("12.50", 1_000_000, 12_500_000), (" 3 ", 1, 3), ("1e3", 1, 1_000)],
)
def test_exact_amount(text: str, scale: int, expected: int) -> None:
    assert exact_amount(text, scale, "--x") == expected


@pytest.mark.parametrize("text", ["0", "-1", "0.0000005", "nan", "inf", "", "1,5"])
def test_exact_amount_refuses(text: str) -> None:
    from billing.errors import InvalidPolicy

    with pytest.raises(InvalidPolicy) as caught:
        exact_amount(text, 1_000_000, "--spend-per-month")
    assert caught.value.field == "--spend-per-month"


def test_the_class_commands_in_their_own_process(tmp_path: Path) -> None:
    home = tmp_path / "zq-home"
    zeroqueue(home, "migrate")
    zeroqueue(home, "class", "add", "batch", "--credit-ppm", "100000")
    assert "batch\t1\t86400000\t0\t100000" in zeroqueue(home, "classes", "list").stdout
    assert "tenant" in zeroqueue(home, "tenants", "policy", "show", "nobody", ok=False).stderr
