"""The `zeroqueue` ledger commands end to end, each in its own process, against a temporary SQLite ledger."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from zeroqueue.metering.v1 import metering_pb2 as pb
from zeroqueue.metering.v1 import metering_pb2_grpc

from billing.period import parse_period
from services.metering.servicer import usage_to_pb
from tests.billing.factories import missed, usage
from tests.metering.conftest import bearer

ROOT = Path(__file__).resolve().parents[2]
PAST = "2021-03"
PAST_START_US = parse_period(PAST).start_us


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "zq-home"


def zeroqueue(home: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ZEROQUEUE_HOME": str(home)}
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode == 0) == ok, (done.returncode, done.stdout, done.stderr)
    if not ok:
        # one error line, last (log lines, on stderr too, may come before it: metering_stopped)
        errors = [line for line in done.stderr.splitlines() if line.startswith("zeroqueue: error: ")]
        assert "Traceback" not in done.stderr and len(errors) == 1, done.stderr
        assert done.stderr.strip().splitlines()[-1] == errors[0], done.stderr
    return done


def test_ledger_commands_end_to_end(home: Path, tmp_path: Path) -> None:
    refused = zeroqueue(home, "invoice", "--tenant", "acme", "--period", PAST, ok=False)
    assert "no schema" in refused.stderr and "zeroqueue migrate" in refused.stderr
    assert "at revision" in zeroqueue(home, "migrate").stdout
    assert (home / "ledger.db").exists()  # the default ledger: $ZEROQUEUE_HOME/ledger.db
    created = zeroqueue(home, "tenants", "create", "acme")
    key = created.stdout.strip()
    assert key.startswith("zq_") and "shown only once" in created.stderr and key not in created.stderr
    assert "already exists" in zeroqueue(home, "tenants", "create", "acme", ok=False).stderr
    admin = zeroqueue(home, "keys", "create-admin").stdout.strip()
    assert admin.startswith("zq_") and admin != key
    price = zeroqueue(
        home,
        "prices",
        "add",
        "--model",
        "tiny",
        "--unit",
        "core_us",
        "--price-micros",
        "1500",
        "--currency",
        "USD",
        "--effective-from",
        "2021-01-01T00:00:00Z",
        "--ledger",
        f"sqlite+pysqlite:///{home}/ledger.db",
    )
    assert "tiny core_us at 1500" in price.stdout
    with_usage(home, admin)

    invoice = json.loads(zeroqueue(home, "invoice", "--tenant", "acme", "--period", PAST, "--format", "json").stdout)
    assert (invoice["status"], invoice["total_micros"]) == ("draft", 4_500)
    assert [(line["kind"], line["amount_micros"]) for line in invoice["lines"]] == [
        ("usage", 6_000),
        ("sla_credit", -1_500),
    ]
    assert [[(k["request_kind"], k["amount_micros"]) for k in line["request_kinds"]] for line in invoice["lines"]] == [
        [("plain", 3_000), ("chat_constrained", 3_000)],
        [("plain", -1_500)],
    ]
    # the prefix cache served 6 of r2's prompt tokens and all 10 of r3's: shown beside them, priced nowhere
    assert [(line["prompt_tokens"], line["cached_prompt_tokens"]) for line in invoice["lines"]] == [(30, 16), (10, 10)]
    out = tmp_path / "invoice.csv"
    zeroqueue(
        home, "invoice", "--tenant", "acme", "--period", PAST, "--finalize", "--format", "csv", "--output", str(out)
    )
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert {row["status"] for row in rows} == {"finalized"} and rows[-1]["kind"] == "total"
    assert rows[-1]["amount_micros"] == "4500" and "request_kind" not in rows[0]  # the CSV scripts already parse
    by_kind = zeroqueue(home, "invoice", "--tenant", "acme", "--period", PAST, "--format", "csv", "--by-request-kind")
    rows = list(csv.DictReader(io.StringIO(by_kind.stdout)))
    assert [(r["kind"], r["request_kind"], r["num_requests"], r["amount_micros"]) for r in rows] == [
        ("usage", "plain", "2", "3000"),
        ("usage", "chat_constrained", "1", "3000"),
        ("sla_credit", "plain", "1", "-1500"),
        ("total", "", "", "4500"),
    ]
    assert (
        "no tenant named 'nobody'"
        in zeroqueue(home, "invoice", "--tenant", "nobody", "--period", PAST, ok=False).stderr
    )

    table = list(
        csv.DictReader(io.StringIO(zeroqueue(home, "chargeback", "--period", PAST, "--by", "cost_center,team").stdout))
    )
    assert [(r["cost_center"], r["team"], r["num_requests"], r["cost_micros"]) for r in table] == [
        ("cc-1", "search", "2", "1500"),
        ("cc-2", "(none)", "1", "3000"),
    ]
    table = list(
        csv.DictReader(io.StringIO(zeroqueue(home, "chargeback", "--period", PAST, "--by", "request_kind").stdout))
    )
    assert [(r["request_kind"], r["num_requests"], r["unit_us"], r["cost_micros"]) for r in table] == [
        ("chat_constrained", "1", "2000000", "3000"),
        ("plain", "2", "2000001", "1500"),
    ]
    # two of the calls came through the HTTP door: the invoice above is what it was, chargeback tells them apart
    table = list(csv.DictReader(io.StringIO(zeroqueue(home, "chargeback", "--period", PAST, "--by", "door").stdout)))
    by_door = [("grpc", "1", "1000000", "1500"), ("http", "2", "3000001", "3000")]  # r3's miss credited
    assert [(r["door"], r["num_requests"], r["unit_us"], r["cost_micros"]) for r in table] == by_door
    report = json.loads(zeroqueue(home, "chargeback", "--period", PAST, "--by", "door", "--format", "json").stdout)
    assert report["group_by"] == ["door"]
    assert [(r["door"], str(r["num_requests"]), str(r["unit_us"]), str(r["cost_micros"])) for r in report["rows"]] == (
        by_door
    )
    # beside each group's prompt tokens, those the prefix cache served
    assert [(r["door"], r["prompt_tokens"], r["cached_prompt_tokens"]) for r in table] == [
        ("grpc", "10", "0"),
        ("http", "20", "16"),
    ]
    assert [(r["door"], r["prompt_tokens"], r["cached_prompt_tokens"]) for r in report["rows"]] == [
        ("grpc", 10, 0),
        ("http", 20, 16),
    ]
    header = zeroqueue(home, "chargeback", "--period", PAST, "--by", "door").stdout.splitlines()[0].split(",")
    assert header[header.index("prompt_tokens") + 1] == "cached_prompt_tokens"
    html_file = tmp_path / "chargeback.html"
    zeroqueue(home, "chargeback", "--period", PAST, "--by", "model", "--format", "html", "--output", str(html_file))
    assert "<img" in html_file.read_text()


def with_usage(home: Path, admin: str) -> None:
    """Usage recorded the way replicas send it: RecordUsage on `zeroqueue metering`, with an admin key."""
    server = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "metering", "--port", "0", "--no-json-logs"],
        cwd=ROOT,
        env={**os.environ, "ZEROQUEUE_HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        address = next(line.split(" on ")[1].strip() for line in server.stdout if "SERVING on" in line)
        records = [
            usage("r1", finished_at_us=PAST_START_US + 10, unit_us=1_000_000),
            usage(
                "r2",
                finished_at_us=PAST_START_US + 20,
                unit_us=2_000_000,
                labels={"cost_center": "cc-2"},
                request_kind="chat_constrained",
                door="http",
                cached_prompt_tokens=6,
            ),
            missed("r3", finished_at_us=PAST_START_US + 30, unit_us=1_000_001, door="http", cached_prompt_tokens=10),
        ]
        with grpc.insecure_channel(address) as channel:
            reply = metering_pb2_grpc.MeteringStub(channel).RecordUsage(
                pb.RecordUsageRequest(records=[usage_to_pb(r) for r in records]), metadata=bearer(admin), timeout=30
            )
        assert {r.status for r in reply.records} == {pb.RECORD_STATUS_ACCEPTED}
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdout.close()


def test_metering_refuses_an_unmigrated_ledger(home: Path) -> None:
    done = zeroqueue(home, "metering", "--port", "0", "--no-json-logs", ok=False)
    assert "zeroqueue migrate" in done.stderr


def test_keys_can_be_listed_and_revoked(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from billing import tenants
    from billing.db import default_ledger_url, make_engine, session_factory, unit_of_work
    from billing.errors import Unauthenticated

    zeroqueue(home, "migrate")
    key = zeroqueue(home, "tenants", "create", "acme").stdout.strip()
    (line,) = zeroqueue(home, "keys", "list").stdout.strip().splitlines()
    key_id, tenant, role, prefix, state = line.split("\t")
    assert (tenant, role, state) == ("acme", "tenant", "active") and key.startswith(prefix.rstrip("…"))
    assert key not in line
    zeroqueue(home, "keys", "revoke", key_id)
    assert zeroqueue(home, "keys", "list", "--tenant", "acme").stdout.strip().endswith("revoked")
    monkeypatch.setenv("ZEROQUEUE_HOME", str(home))
    engine = make_engine(default_ledger_url())
    try:
        with unit_of_work(session_factory(engine)) as session, pytest.raises(Unauthenticated):
            tenants.authenticate(session, key)
    finally:
        engine.dispose()
    assert "no API key 999" in zeroqueue(home, "keys", "revoke", "999", ok=False).stderr
