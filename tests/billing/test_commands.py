"""The CLI-facing functions end to end, and the JSON, CSV and HTML renderings."""

from __future__ import annotations

import base64
import csv
import io
import json
import re
from pathlib import Path

import pytest

from billing import commands
from billing.db import default_ledger_url, unit_of_work
from billing.errors import InvalidArgument
from billing.ledger import ingest_idle, ingest_usage
from billing.period import parse_period
from billing.render import format_micros
from billing.tenants import authenticate
from tests.billing.conftest import Ledger
from tests.billing.factories import idle, missed, usage

PAST = "2021-03"  # long over, so it can be finalized whatever the clock says
PAST_START_US = parse_period(PAST).start_us


@pytest.fixture
def acme_key(ledger: Ledger) -> str:
    key = commands.create_tenant(ledger.url, "acme")
    commands.add_price(ledger.url, "tiny", "core_us", 1_500, "USD", "2021-01-01T00:00:00Z")
    with unit_of_work(ledger.sessions) as session:
        ingest_usage(
            session,
            [
                usage("r1", finished_at_us=PAST_START_US + 10, unit_us=1_000_000),
                usage("r2", finished_at_us=PAST_START_US + 20, unit_us=2_000_000, labels={"cost_center": "cc-2"}),
                missed("r3", finished_at_us=PAST_START_US + 30, unit_us=1_000_001),
            ],
        )
        ingest_idle(session, [idle("cpu:host-a", 0, 200_000_000, start_us=PAST_START_US)])
    return key


def png_images(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'<img [^>]*src="data:image/png;base64,([^"]+)"', page)]


def test_create_tenant_prints_a_working_key(ledger: Ledger, acme_key: str) -> None:
    with ledger.sessions() as session:
        assert authenticate(session, acme_key).tenant == "acme"


def test_invoice_in_every_format(ledger: Ledger, acme_key: str) -> None:
    as_json = json.loads(commands.invoice(ledger.url, "acme", PAST, False, "json"))
    assert (as_json["status"], as_json["total_micros"], as_json["total"]) == ("draft", 4_500, "0.004500")
    assert [(line["kind"], line["amount_micros"]) for line in as_json["lines"]] == [
        ("usage", 6_000),
        ("sla_credit", -1_500),
    ]
    table = list(csv.DictReader(io.StringIO(commands.invoice(ledger.url, "acme", PAST, False, "csv"))))
    assert [(row["kind"], row["amount_micros"], row["amount"]) for row in table] == [
        ("usage", "6000", "0.006000"),
        ("sla_credit", "-1500", "-0.001500"),
        ("total", "4500", "0.004500"),
    ]
    page = commands.invoice(ledger.url, "acme", PAST, False, "html")
    assert "<table>" in page and "0.004500 USD" in page
    assert all(image.startswith(b"\x89PNG\r\n\x1a\n") for image in png_images(page)) and png_images(page)


def test_finalize_then_the_invoice_stays_as_it_was(ledger: Ledger, acme_key: str) -> None:
    final = json.loads(commands.invoice(ledger.url, "acme", PAST, True, "json"))
    assert final["status"] == "finalized"
    with unit_of_work(ledger.sessions) as session:
        ingest_usage(session, [usage("late", finished_at_us=PAST_START_US + 40)])
    again = json.loads(commands.invoice(ledger.url, "acme", PAST, False, "json"))
    assert again == final


def test_chargeback_in_every_format(ledger: Ledger, acme_key: str) -> None:
    table = list(csv.DictReader(io.StringIO(commands.chargeback(ledger.url, PAST, ["cost_center"], "csv"))))
    assert [(r["cost_center"], r["num_requests"], r["cost_micros"], r["cost"], r["attainment"]) for r in table] == [
        ("cc-1", "2", "1500", "0.001500", "50.00%"),
        ("cc-2", "1", "3000", "0.003000", "100.00%"),
    ]
    report = json.loads(commands.chargeback(ledger.url, PAST, ["team", "day"], "json"))
    assert [(r["team"], r["day"], r["num_requests"]) for r in report["rows"]] == [
        ("(none)", "2021-03-01", 1),
        ("search", "2021-03-01", 2),
    ]
    assert report["devices"][0]["idle_unit_us"] == 200_000_000
    page = commands.chargeback(ledger.url, PAST, ["cost_center"], "html")
    images = png_images(page)
    assert len(images) == 2 and all(image.startswith(b"\x89PNG") for image in images)  # cost, utilisation
    with pytest.raises(InvalidArgument) as caught:
        commands.chargeback(ledger.url, PAST, ["model"], "xml")
    assert caught.value.field == "format"


def test_migrate_is_idempotent_and_the_default_ledger_lives_in_zeroqueue_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZEROQUEUE_HOME", str(tmp_path / "home"))
    assert default_ledger_url() == f"sqlite+pysqlite:///{tmp_path / 'home' / 'ledger.db'}"
    commands.migrate(None)
    commands.migrate(None)
    key = commands.create_tenant(None, "acme")
    assert key.startswith("zq_") and (tmp_path / "home" / "ledger.db").exists()


@pytest.mark.parametrize(
    ("micros", "text"),
    [(0, "0.000000"), (1, "0.000001"), (-1, "-0.000001"), (1_234_567, "1.234567"), (-(10**12), "-1000000.000000")],
)
def test_money_text_is_computed_from_integers(micros: int, text: str) -> None:
    assert format_micros(micros) == text
