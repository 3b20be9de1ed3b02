"""A command's stdout is its product: every `zeroqueue` command that prints a result (a key, CSV, JSON, HTML, a
table) prints only that on stdout, even when it has something to warn about. Each runs in its own process against
a ledger in a directory others may list (0755), so each logs `directory_open_to_others`: on stderr, once, and
without colours (stderr is a pipe here).

The commands are cli_billing.py's and cli_service_classes.py's that print; `metering`, `serve` and `pulse` run
until stopped (their stdout is a progress line), `keys revoke` prints to stderr alone.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog

from services.logs import configure_logging

ROOT = Path(__file__).resolve().parents[2]
PAST = "2021-03"
CLASS_HEADER = ["name", "min_budget_ms", "max_budget_ms", "priority", "credit_ppm"]


def zeroqueue(ledger: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("FORCE_COLOR", "NO_COLOR")}
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *args, "--ledger", ledger],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    return done


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A migrated ledger with tenant acme and class gold, in a directory others may list."""
    shared = tmp_path_factory.mktemp("shared")
    shared.chmod(0o755)
    url = f"sqlite+pysqlite:///{shared}/ledger.db"
    zeroqueue(url, "migrate")
    zeroqueue(url, "tenants", "create", "acme")
    zeroqueue(url, "classes", "add", "gold", "--credit-ppm", "500000")
    return url


def key(stdout: str) -> None:
    assert len(stdout.splitlines()) == 1 and stdout.strip().startswith("zq_"), stdout


def one_line(prefix: str) -> Callable[[str], None]:
    def check(stdout: str) -> None:
        assert len(stdout.splitlines()) == 1 and stdout.startswith(prefix), stdout

    return check


def csv_with(column: str) -> Callable[[str], None]:
    def check(stdout: str) -> None:
        rows = list(csv.reader(io.StringIO(stdout)))
        assert rows and column in rows[0], stdout
        assert all(len(row) == len(rows[0]) for row in rows), stdout

    return check


def json_doc(stdout: str) -> None:
    assert isinstance(json.loads(stdout), dict), stdout


def html_page(stdout: str) -> None:
    assert stdout.lstrip().lower().startswith("<!doctype html") and "</html>" in stdout, stdout[:200]


def table(header: list[str] | None, num_columns: int) -> Callable[[str], None]:
    """Tab-separated lines of ``num_columns`` fields, the first of them ``header`` when given."""

    def check(stdout: str) -> None:
        rows = [line.split("\t") for line in stdout.splitlines()]
        assert rows and all(len(row) == num_columns for row in rows), stdout
        if header is not None:
            assert rows[0] == header, stdout

    return check


def tenant_policy(stdout: str) -> None:
    table(None, 2)(stdout)
    assert [line.split("\t")[0] for line in stdout.splitlines()][:2] == ["tenant", "weight"], stdout


COMMANDS = {
    "migrate": (["migrate"], one_line("ledger ")),
    "tenants create": (["tenants", "create", "beta"], key),
    "keys create-admin": (["keys", "create-admin"], key),
    "keys list": (["keys", "list"], table(None, 5)),
    "prices add": (
        ["prices", "add", "--model", "tiny", "--unit", "core_us", "--price-micros", "1500"]
        + ["--effective-from", "2021-01-01T00:00:00Z"],
        one_line("price "),
    ),
    "invoice json": (["invoice", "--tenant", "acme", "--period", PAST, "--format", "json"], json_doc),
    "invoice csv": (["invoice", "--tenant", "acme", "--period", PAST, "--format", "csv"], csv_with("kind")),
    "invoice html": (["invoice", "--tenant", "acme", "--period", PAST, "--format", "html"], html_page),
    "invoice csv by request kind": (
        ["invoice", "--tenant", "acme", "--period", PAST, "--format", "csv", "--by-request-kind"],
        csv_with("request_kind"),
    ),
    "chargeback csv": (["chargeback", "--period", PAST, "--format", "csv"], csv_with("cost_center")),
    "chargeback json": (["chargeback", "--period", PAST, "--format", "json"], json_doc),
    "chargeback html": (["chargeback", "--period", PAST, "--format", "html"], html_page),
    "chargeback by request kind": (["chargeback", "--period", PAST, "--by", "request_kind"], csv_with("request_kind")),
    "chargeback by door": (["chargeback", "--period", PAST, "--by", "door"], csv_with("door")),
    "chargeback by weight dtype": (
        ["chargeback", "--period", PAST, "--by", "model,weight_dtype"],
        csv_with("weight_dtype"),
    ),
    "classes add": (["classes", "add", "silver", "--credit-ppm", "0"], table(CLASS_HEADER, 5)),
    "classes update": (["classes", "update", "gold", "--priority", "10"], table(CLASS_HEADER, 5)),
    "classes list": (["classes", "list"], table(CLASS_HEADER, 5)),
    "tenants policy set": (["tenants", "policy", "set", "acme", "--weight", "2"], tenant_policy),
    "tenants policy show": (["tenants", "policy", "show", "acme"], tenant_policy),
}


@pytest.mark.parametrize("name", COMMANDS)
def test_stdout_is_the_result_alone_and_the_warning_goes_to_stderr_once(ledger: str, name: str) -> None:
    args, parses = COMMANDS[name]
    done = zeroqueue(ledger, *args)
    assert "directory_open_to_others" not in done.stdout and "\x1b[" not in done.stdout
    parses(done.stdout)
    # the command opens the ledger more than once; the warning is the same each time, so it is printed once
    assert done.stderr.count("directory_open_to_others") == 1, done.stderr
    assert "\x1b[" not in done.stderr, done.stderr  # stderr is no terminal: no colour codes


def test_logs_go_to_the_stderr_of_the_moment_and_an_identical_warning_prints_once(capsys) -> None:
    configure_logging()
    try:
        log = structlog.get_logger("test")
        for path in ("/a", "/a", "/b", "/a"):
            log.warning("directory_open_to_others", path=path)
        log.info("step", n=1)
        log.info("step", n=1)  # only warnings are kept to once
        out, err = capsys.readouterr()
    finally:
        structlog.reset_defaults()
    assert out == ""
    assert (err.count("path=/a"), err.count("path=/b"), err.count("step")) == (1, 1, 2), err


class Writes(io.StringIO):
    """A stderr that keeps each write call apart."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_each_log_line_is_one_write_with_its_newline(monkeypatch) -> None:
    # two processes sharing a stream (the engine child and the server) must never split a line between them:
    # a line and its newline written apart let another process's line land in between
    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    configure_logging(json_logs=True)
    try:
        structlog.get_logger("test").info("step_done", n=1)
    finally:
        structlog.reset_defaults()
    (line,) = stderr.calls
    assert line.endswith("\n") and json.loads(line)["event"] == "step_done"
