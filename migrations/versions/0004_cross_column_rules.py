"""The money rules that cross columns, enforced by the database whoever writes.

billing/records.py has refused these since the first ledger; now the database refuses them too:
- usage_records: the unit is the device kind's (sm_us on a cuda device, core_us on a cpu one), and the device_id
  is of that kind (GPU-… or MIG-… on cuda, cpu:… on cpu);
- usage_records: deadline_met agrees with the times and the outcome: a deadline met was not finished after it;
  a call whose outcome is deadline_exceeded did not meet it; a call whose outcome is ok met it exactly when it
  finished by it (cancelled and error calls may have missed a deadline they finished before);
- idle_records: the device_id is of the unit's kind (there is no device_kind column).

As in 0003, PostgreSQL gets CHECK constraints and SQLite gets BEFORE INSERT triggers that
RAISE(ABORT, 'CHECK constraint failed: <name>'): a batch copy of the table would drop the append-only triggers
of 0001 and the bound triggers of 0003. Both tables are append-only, so INSERT is the only write to guard.
Rows written before this revision are checked first; if any breaks a rule the upgrade stops and names it (a
migration never rewrites money). The SQL is frozen here with the revision; billing/models.py declares the same
expressions (tests/billing/test_migrations.py compares them).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_GPU_ID = "(substr({r}device_id, 1, 4) = 'GPU-' OR substr({r}device_id, 1, 4) = 'MIG-')"
_CPU_ID = "(substr({r}device_id, 1, 4) = 'cpu:')"

# (table, constraint, expression over the row's columns as {r}column)
CHECKS = (
    ("usage_records", "ck_usage_records_unit_of_device_kind",
     "({r}device_kind = 'cuda' AND {r}unit = 'sm_us') OR ({r}device_kind = 'cpu' AND {r}unit = 'core_us')"),
    ("usage_records", "ck_usage_records_device_id_of_kind",
     f"({{r}}device_kind = 'cuda' AND {_GPU_ID}) OR ({{r}}device_kind = 'cpu' AND {_CPU_ID})"),
    ("usage_records", "ck_usage_records_deadline_met_on_time",
     "NOT {r}deadline_met OR {r}finished_at_us <= {r}deadline_at_us"),
    ("usage_records", "ck_usage_records_deadline_exceeded_not_met",
     "{r}outcome <> 'deadline_exceeded' OR NOT {r}deadline_met"),
    ("usage_records", "ck_usage_records_ok_deadline_met_is_on_time",
     "{r}outcome <> 'ok' OR {r}deadline_met = ({r}finished_at_us <= {r}deadline_at_us)"),
    ("idle_records", "ck_idle_records_device_id_of_unit",
     f"({{r}}unit = 'sm_us' AND {_GPU_ID}) OR ({{r}}unit = 'core_us' AND {_CPU_ID})"),
)


def _trigger(constraint: str) -> str:
    return f"trg_{constraint}_insert"


def upgrade() -> None:
    bind = op.get_bind()
    for table, constraint, expression in CHECKS:
        broken = bind.execute(sa.text(f"SELECT count(*) FROM {table} WHERE NOT ({expression.format(r='')})"))
        count = broken.scalar_one()
        if count:
            raise RuntimeError(
                f"revision 0004: {count} row(s) of {table} break {constraint}, written before the ledger enforced "
                f"it; review them (SELECT * FROM {table} WHERE NOT ({expression.format(r='')})) and migrate again")
    for table, constraint, expression in CHECKS:
        if bind.dialect.name == "postgresql":
            op.create_check_constraint(op.f(constraint), table, expression.format(r=""))
            continue
        op.execute(
            f"CREATE TRIGGER {_trigger(constraint)} BEFORE INSERT ON {table} FOR EACH ROW "
            f"WHEN NOT ({expression.format(r='NEW.')}) "
            f"BEGIN SELECT RAISE(ABORT, 'CHECK constraint failed: {constraint}'); END")


def downgrade() -> None:
    for table, constraint, _ in reversed(CHECKS):
        if op.get_bind().dialect.name == "postgresql":
            op.drop_constraint(op.f(constraint), table, type_="check")
            continue
        op.execute(f"DROP TRIGGER {_trigger(constraint)}")
