"""Classes of service, prices per class, and each tenant's weight and quotas.

- service_classes: the operator's classes (a name, the budgets it accepts, a priority under overload, and the
  share of a missed call's charge credited). One class, `standard` (every budget, priority 0, 100 % credit: the
  rule before this revision), is made here, so a ledger without classes of its own bills as before. A class is
  never deleted and its credit rule never changes (a new rule is a new class): both decide money.
- prices.service_class: a price row may name a class; '' is the price of every class without one of its own.
  The uniqueness of a price version becomes (model, unit, service_class, effective_from_us).
- usage_records.service_class and invoice_lines.service_class: the class a call ran in (existing rows:
  `standard`).
- tenant_policies: a tenant's weight in fair share and its optional caps (device time and spend per UTC month,
  calls per second). A tenant without a row has weight 1 and no caps.

SQLite cannot drop a table's UNIQUE constraint in place, so prices is copied (Alembic's batch mode); the copy
would lose prices' triggers (append-only from 0001, bounds from 0003), so their SQL is read from sqlite_master
first and run again after. Foreign keys from invoice_lines to prices: migrations/env.py runs SQLite migrations
with enforcement off and checks every foreign key before the commit (SQLite's procedure for a table rebuild).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_MAX_BUDGET_MS = 86_400_000  # a day: no call's gRPC deadline is longer (services/parsing.py bounds it tighter)
_OLD_PRICE_KEY = ("model", "unit", "effective_from_us")
_NEW_PRICE_KEY = ("model", "unit", "service_class", "effective_from_us")

_SQLITE_CLASS_TRIGGERS = (
    "CREATE TRIGGER trg_service_classes_no_delete BEFORE DELETE ON service_classes FOR EACH ROW "
    "BEGIN SELECT RAISE(ABORT, 'service_classes: a class is never deleted'); END",
    "CREATE TRIGGER trg_service_classes_credit_fixed BEFORE UPDATE ON service_classes FOR EACH ROW "
    "WHEN NEW.credit_ppm IS NOT OLD.credit_ppm OR NEW.name IS NOT OLD.name "
    "BEGIN SELECT RAISE(ABORT, 'service_classes: a class keeps its name and credit rule'); END",
)
_POSTGRESQL_CLASS_SQL = (
    """
    CREATE FUNCTION zq_guard_service_class() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'service_classes: a class is never deleted' USING ERRCODE = 'restrict_violation';
      END IF;
      IF NEW.credit_ppm IS DISTINCT FROM OLD.credit_ppm OR NEW.name IS DISTINCT FROM OLD.name THEN
        RAISE EXCEPTION 'service_classes: a class keeps its name and credit rule'
          USING ERRCODE = 'restrict_violation';
      END IF;
      RETURN NEW;
    END $$
    """,
    "CREATE TRIGGER trg_service_classes_guard BEFORE UPDATE OR DELETE ON service_classes "
    "FOR EACH ROW EXECUTE FUNCTION zq_guard_service_class()",
)


def _create_tables() -> None:
    op.create_table(
        "service_classes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("min_budget_ms", sa.BigInteger(), nullable=False),
        sa.Column("max_budget_ms", sa.BigInteger(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("credit_ppm", sa.Integer(), nullable=False),
        sa.Column("created_at_us", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("length(name) >= 1", name=op.f("ck_service_classes_name_not_empty")),
        sa.CheckConstraint(
            f"min_budget_ms >= 1 AND max_budget_ms >= min_budget_ms AND max_budget_ms <= {_MAX_BUDGET_MS}",
            name=op.f("ck_service_classes_budget_range"),
        ),
        sa.CheckConstraint("priority >= 0 AND priority <= 100", name=op.f("ck_service_classes_priority_range")),
        sa.CheckConstraint("credit_ppm >= 0 AND credit_ppm <= 1000000", name=op.f("ck_service_classes_credit_range")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_service_classes")),
        sa.UniqueConstraint("name", name=op.f("uq_service_classes_name")),
    )
    op.create_table(
        "tenant_policies",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Integer(), nullable=False),
        sa.Column("device_us_per_month", sa.BigInteger(), nullable=True),
        sa.Column("spend_micros_per_month", sa.BigInteger(), nullable=True),
        sa.Column("calls_per_s", sa.Integer(), nullable=True),
        sa.Column("updated_at_us", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("weight >= 1 AND weight <= 1000", name=op.f("ck_tenant_policies_weight_range")),
        sa.CheckConstraint(
            "(device_us_per_month IS NULL OR device_us_per_month > 0) AND "
            "(spend_micros_per_month IS NULL OR spend_micros_per_month > 0) AND "
            "(calls_per_s IS NULL OR calls_per_s > 0)",
            name=op.f("ck_tenant_policies_caps_positive"),
        ),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_tenant_policies_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_tenant_policies")),
    )
    op.bulk_insert(
        sa.table(
            "service_classes",
            *(sa.column(name) for name in ("name", "min_budget_ms", "max_budget_ms", "priority", "credit_ppm")),
            sa.column("created_at_us"),
        ),
        [
            dict(
                name="standard",
                min_budget_ms=1,
                max_budget_ms=_MAX_BUDGET_MS,
                priority=0,
                credit_ppm=1_000_000,
                created_at_us=time.time_ns() // 1000,
            )
        ],
    )


def _sqlite_triggers_of(table: str) -> list[str]:
    rows = op.get_bind().execute(
        sa.text("SELECT sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = :t ORDER BY name"), {"t": table}
    )
    return [row[0] for row in rows]


def _rekey_prices(old: tuple[str, ...], new: tuple[str, ...], *, add_class: bool) -> None:
    """Replace prices' unique key `old` by `new`, adding or dropping prices.service_class with it."""
    sqlite = op.get_bind().dialect.name == "sqlite"
    triggers = _sqlite_triggers_of("prices") if sqlite else []
    with op.batch_alter_table("prices", recreate="always" if sqlite else "auto") as batch:
        batch.drop_constraint(op.f("uq_prices_" + "_".join(old)), type_="unique")
        if add_class:
            batch.add_column(sa.Column("service_class", sa.String(length=32), nullable=False, server_default=""))
        else:
            batch.drop_column("service_class")
        batch.create_unique_constraint(op.f("uq_prices_" + "_".join(new)), list(new))
    for sql in triggers:
        op.execute(sql)


def upgrade() -> None:
    _create_tables()
    if op.get_bind().dialect.name == "postgresql":
        for sql in _POSTGRESQL_CLASS_SQL:
            op.execute(sql)
    else:
        for sql in _SQLITE_CLASS_TRIGGERS:
            op.execute(sql)
    _rekey_prices(_OLD_PRICE_KEY, _NEW_PRICE_KEY, add_class=True)
    for table in ("usage_records", "invoice_lines"):
        op.add_column(
            table, sa.Column("service_class", sa.String(length=32), nullable=False, server_default="standard")
        )


_CLASSED = (
    ("prices", "price row(s)", "''"),
    ("usage_records", "usage record(s)", "'standard'"),  # their class decides their price and credit
    ("invoice_lines", "invoice line(s)", "'standard'"),
)


def _refuse_classed_rows() -> None:
    for table, what, default in _CLASSED:
        where = f"service_class <> {default}"
        classed = op.get_bind().execute(sa.text(f"SELECT count(*) FROM {table} WHERE {where}")).scalar_one()
        if classed:
            raise RuntimeError(
                f"revision 0005: {classed} {what} name a class; a ledger before 0005 cannot hold them, and a "
                f"migration never drops money (SELECT * FROM {table} WHERE {where})"
            )


def downgrade() -> None:
    bind = op.get_bind()
    _refuse_classed_rows()
    for table in ("invoice_lines", "usage_records"):
        if bind.dialect.name == "sqlite":
            triggers = _sqlite_triggers_of(table)
            for sql in triggers:  # SQLite refuses DROP COLUMN on a table whose triggers it cannot re-check
                op.execute(f"DROP TRIGGER {sql.split()[2]}")
            op.drop_column(table, "service_class")
            for sql in triggers:
                op.execute(sql)
        else:
            op.drop_column(table, "service_class")
    _rekey_prices(_NEW_PRICE_KEY, _OLD_PRICE_KEY, add_class=False)
    op.drop_table("tenant_policies")
    op.drop_table("service_classes")
    if bind.dialect.name == "postgresql":
        op.execute("DROP FUNCTION zq_guard_service_class()")
