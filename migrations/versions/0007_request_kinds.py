"""usage_records.request_kind: which kind of Generate call a record bills (issue 31); invoice lines split by it.

- usage_records.request_kind: 'plain' (a prompt or token ids, free text), 'chat' (messages through the chat
  template), 'constrained' (a prompt with a response format) or 'chat_constrained' (both). NOT NULL, server
  default 'plain': every row written before this revision is plain, as every call was. Enforced by
  ck_usage_records_request_kind on both databases. A record's kind is part of its payload digest only when it is
  not plain (billing/records.py), so a row stored before and shipped again after is still a DUPLICATE.
- invoice_line_request_kinds: each invoice line's usage per request kind (requests, unit·µs, tokens, and the
  line's amount split over its kinds by unit·µs), keyed by the line (a foreign key to invoice_lines' (invoice_id,
  position), ON DELETE CASCADE: a draft's lines are rebuilt on every refresh) and frozen with its invoice like the
  line itself (the triggers of 0001, the same rule). Lines stored before this revision get one 'plain' row equal
  to the line, written before the triggers exist, so a finalized invoice lists its kinds too.

SQLite adds the column in place (ALTER TABLE ... ADD COLUMN, its CHECK in the column's definition, which SQLite
accepts there and tests against the rows already present), so usage_records is not copied and keeps its triggers
(append-only from 0001, bounds from 0003, cross-column rules from 0004). PostgreSQL adds the column, then the
CHECK. The expressions are frozen here; billing/models.py declares the same (tests/billing/test_migration_0007.py
compares them).

Going back to 0006 is refused while any usage record names a kind other than plain: a ledger before 0007 cannot
hold it, and a migration never drops what decides money. The invoice lines' kinds, then all plain copies of their
lines, go with their table.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-16
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

BigIntPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
KINDS = ("plain", "chat", "constrained", "chat_constrained")
# (table, constraint, expression): the CHECKs this revision installs
CHECKS = (
    ("usage_records", "ck_usage_records_request_kind", f"request_kind IN ({', '.join(map(repr, KINDS))})"),
    (
        "invoice_line_request_kinds",
        "ck_invoice_line_request_kinds_request_kind",
        f"request_kind IN ({', '.join(map(repr, KINDS))})",
    ),
    (
        "invoice_line_request_kinds",
        "ck_invoice_line_request_kinds_usage",
        "num_requests >= 1 AND unit_us >= 0 AND prompt_tokens >= 0 AND completion_tokens >= 0",
    ),
)
_USAGE_KIND = CHECKS[0][2]
_TABLE = "invoice_line_request_kinds"
_STATUS_OF = "(SELECT status FROM invoices WHERE id = {}.invoice_id)"
_SQLITE_FROZEN = (  # 0001's rule for invoice_lines: no write unless the invoice is a draft
    ("INSERT", f"{_STATUS_OF.format('NEW')} IS NOT 'draft'"),
    ("UPDATE", f"{_STATUS_OF.format('OLD')} IS NOT 'draft' OR {_STATUS_OF.format('NEW')} IS NOT 'draft'"),
    ("DELETE", f"{_STATUS_OF.format('OLD')} IS NOT 'draft'"),
)
# 0001's zq_guard_invoice_line reads only the row's invoice_id, so it guards these rows as it guards the lines
_POSTGRESQL_FROZEN = (
    f"CREATE TRIGGER trg_{_TABLE}_guard BEFORE INSERT OR UPDATE OR DELETE ON {_TABLE} "
    "FOR EACH ROW EXECUTE FUNCTION zq_guard_invoice_line()"
)


def _add_usage_kind() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.add_column(
            "usage_records", sa.Column("request_kind", sa.String(length=32), nullable=False, server_default="plain")
        )
        op.create_check_constraint(op.f("ck_usage_records_request_kind"), "usage_records", _USAGE_KIND)
        return
    op.execute(
        "ALTER TABLE usage_records ADD COLUMN request_kind VARCHAR(32) DEFAULT 'plain' NOT NULL "
        f"CONSTRAINT ck_usage_records_request_kind CHECK ({_USAGE_KIND})"
    )


def _create_line_kinds() -> None:
    op.create_table(
        _TABLE,
        sa.Column("id", BigIntPK, nullable=False),
        sa.Column("invoice_id", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("request_kind", sa.String(length=32), nullable=False),
        *(
            sa.Column(name, sa.BigInteger(), nullable=False)
            for name in ("num_requests", "unit_us", "prompt_tokens", "completion_tokens", "amount_micros")
        ),
        *(sa.CheckConstraint(expression, name=op.f(name)) for table, name, expression in CHECKS if table == _TABLE),
        sa.ForeignKeyConstraint(
            ["invoice_id", "position"],
            ["invoice_lines.invoice_id", "invoice_lines.position"],
            name=op.f(f"fk_{_TABLE}_invoice_id_invoice_lines"),
            ondelete="CASCADE",  # a line's kinds go with it (a draft's lines are rebuilt on every refresh)
        ),
        sa.PrimaryKeyConstraint("id", name=op.f(f"pk_{_TABLE}")),
        sa.UniqueConstraint(
            "invoice_id", "position", "request_kind", name=op.f(f"uq_{_TABLE}_invoice_id_position_request_kind")
        ),
    )
    columns = "num_requests, unit_us, prompt_tokens, completion_tokens, amount_micros"
    op.execute(  # the lines already stored: every call before kinds was plain
        f"INSERT INTO {_TABLE} (invoice_id, position, request_kind, {columns}) "
        f"SELECT invoice_id, position, 'plain', {columns} FROM invoice_lines"
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_POSTGRESQL_FROZEN)
        return
    for timing, when in _SQLITE_FROZEN:
        op.execute(
            f"CREATE TRIGGER trg_{_TABLE}_frozen_{timing.lower()} BEFORE {timing} ON {_TABLE} FOR EACH ROW "
            f"WHEN {when} BEGIN SELECT RAISE(ABORT, 'invoice is not a draft: line kind {timing} refused'); END"
        )


def upgrade() -> None:
    _add_usage_kind()
    _create_line_kinds()


def downgrade() -> None:
    bind = op.get_bind()
    where = "request_kind <> 'plain'"
    kinded = bind.execute(sa.text(f"SELECT count(*) FROM usage_records WHERE {where}")).scalar_one()
    if kinded:
        raise RuntimeError(
            f"revision 0007: {kinded} usage record(s) name a request kind other than plain; a ledger before 0007 "
            f"cannot hold them, and a migration never drops what decides money (SELECT * FROM usage_records WHERE "
            f"{where})"
        )
    op.drop_table(_TABLE)  # its triggers go with it; every row left is a plain copy of its line
    if bind.dialect.name == "postgresql":
        op.drop_constraint(op.f("ck_usage_records_request_kind"), "usage_records", type_="check")
    op.drop_column("usage_records", "request_kind")
