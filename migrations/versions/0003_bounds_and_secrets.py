"""Bounds the database enforces, whoever writes; and the ledger's page-token secret.

- invoices.period is ASCII 'YYYY-MM' with a month 01..12: '２０２６-１２' and '٢٠٢٦-١٢' were other spellings of
  2026-12 that opened more than one invoice for the same month.
- usage_records and idle_records hold values whose monthly sums can be summed exactly (see billing/records.py
  and billing/aggregate.py): times before 2200, at most 4,096 units, unit_us ≤ num_units × 31 days, tokens in
  int32, an idle record's wall time at most a minute of its units; prices at most 10^9 micros per unit·second.
- ledger_secrets holds the key that signs QueryUsage page tokens (billing/page_tokens.py), made here.

PostgreSQL gets CHECK constraints. SQLite cannot add one to an existing table without copying the table, which
would drop the append-only triggers (see 0002), so the same expressions are BEFORE INSERT/UPDATE triggers that
RAISE(ABORT, 'CHECK constraint failed: <name>'): an IntegrityError with SQLite's own wording for a CHECK.
Rows written before this revision are checked first; if any breaks a rule the upgrade stops and names it (a
migration never rewrites money). The SQL is frozen here with the revision, like 0001's triggers.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import secrets
import time

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_DIGIT = "('0', '1', '2', '3', '4', '5', '6', '7', '8', '9')"
_MONTH = "('01', '02', '03', '04', '05', '06', '07', '08', '09', '10', '11', '12')"
_MAX_TIME_US = 7_258_118_400_000_000        # 2200-01-01T00:00:00Z

# (table, constraint, expression over the row's columns as {r}column, statements it guards on SQLite)
CHECKS = (
    ("invoices", "ck_invoices_period_format",
     "length({r}period) = 7 AND substr({r}period, 5, 1) = '-' AND "
     + " AND ".join(f"substr({{r}}period, {i}, 1) IN {_DIGIT}" for i in (1, 2, 3, 4))
     + f" AND substr({{r}}period, 6, 2) IN {_MONTH}", ("INSERT", "UPDATE")),
    ("usage_records", "ck_usage_records_num_units_range", "{r}num_units <= 4096", ("INSERT",)),
    ("usage_records", "ck_usage_records_unit_us_range", "{r}unit_us <= {r}num_units * 2678400000000", ("INSERT",)),
    ("usage_records", "ck_usage_records_tokens_range",
     "{r}prompt_tokens <= 2147483647 AND {r}completion_tokens <= 2147483647", ("INSERT",)),
    ("usage_records", "ck_usage_records_times_range",
     "{r}received_at_us >= 1 AND {r}dispatched_at_us >= {r}received_at_us AND {r}finished_at_us >= "
     f"{{r}}dispatched_at_us AND {{r}}finished_at_us < {_MAX_TIME_US} AND {{r}}deadline_at_us >= 1 AND "
     "({r}first_token_at_us IS NULL OR ({r}first_token_at_us >= {r}dispatched_at_us AND "
     "{r}first_token_at_us <= {r}finished_at_us))", ("INSERT",)),
    ("idle_records", "ck_idle_records_num_units_range", "{r}num_units <= 4096", ("INSERT",)),
    ("idle_records", "ck_idle_records_minute_range",
     f"{{r}}minute_start_us >= 0 AND {{r}}minute_start_us < {_MAX_TIME_US}", ("INSERT",)),
    ("idle_records", "ck_idle_records_wall_range",
     "{r}wall_unit_us >= 1 AND {r}wall_unit_us <= {r}num_units * 60000000", ("INSERT",)),
    ("prices", "ck_prices_price_range", "{r}price_micros <= 1000000000", ("INSERT",)),
)


def _trigger(constraint: str, timing: str) -> str:
    return f"trg_{constraint}_{timing.lower()}"


def upgrade() -> None:
    bind = op.get_bind()
    for table, constraint, expression, _ in CHECKS:
        broken = bind.execute(sa.text(f"SELECT count(*) FROM {table} WHERE NOT ({expression.format(r='')})"))
        count = broken.scalar_one()
        if count:
            raise RuntimeError(
                f"revision 0003: {count} row(s) of {table} break {constraint}, written before the ledger enforced "
                f"it; review them (SELECT * FROM {table} WHERE NOT ({expression.format(r='')})) and migrate again")
    for table, constraint, expression, timings in CHECKS:
        if bind.dialect.name == "postgresql":
            op.create_check_constraint(op.f(constraint), table, expression.format(r=""))
            continue
        for timing in timings:
            op.execute(
                f"CREATE TRIGGER {_trigger(constraint, timing)} BEFORE {timing} ON {table} FOR EACH ROW "
                f"WHEN NOT ({expression.format(r='NEW.')}) "
                f"BEGIN SELECT RAISE(ABORT, 'CHECK constraint failed: {constraint}'); END")
    op.create_table(
        "ledger_secrets",
        sa.Column("name", sa.String(32), nullable=False),
        sa.Column("secret", sa.String(64), nullable=False),
        sa.Column("created_at_us", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_ledger_secrets")),
    )
    bind.execute(sa.text("INSERT INTO ledger_secrets (name, secret, created_at_us) VALUES ('page_token', :s, :t)"),
                 {"s": secrets.token_hex(32), "t": time.time_ns() // 1000})


def downgrade() -> None:
    op.drop_table("ledger_secrets")
    for table, constraint, _, timings in reversed(CHECKS):
        if op.get_bind().dialect.name == "postgresql":
            op.drop_constraint(op.f(constraint), table, type_="check")
            continue
        for timing in timings:
            op.execute(f"DROP TRIGGER {_trigger(constraint, timing)}")
