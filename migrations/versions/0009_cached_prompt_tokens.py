"""cached_prompt_tokens: the leading prompt tokens the replica's prefix cache served (issue 33).

- usage_records.cached_prompt_tokens: of a call's prompt_tokens, those whose KV blocks an earlier call of the same
  tenant had computed, so this call skipped their prefill. NOT NULL, server default 0: no row written before this
  revision was served by a cache, there was none. Enforced by ck_usage_records_cached_prompt_tokens on both
  databases (0 <= cached_prompt_tokens <= prompt_tokens). A record's count is part of its payload digest only when
  it is not 0 (billing/records.py), so a row stored before and shipped again after is still a DUPLICATE, and the
  same call_id with another count is a CONFLICT.
- invoice_lines.cached_prompt_tokens and invoice_line_request_kinds.cached_prompt_tokens: the same count summed over
  the line's usage (or, on an SLA credit line, its missed usage), beside its prompt_tokens, frozen with the invoice
  like every other column of its line (the triggers of 0001 and 0007). Lines stored before this revision read 0,
  which is what their usage holds. Each has the same CHECK.

Device time stays the measured truth: a call that hit the cache measured less and is billed less, and the count only
shows what the cache served; no amount or total changes.

SQLite adds each column in place (ALTER TABLE ... ADD COLUMN, its CHECK in the column's definition, as 0007 and 0008
do; SQLite tests it against the rows already present), so no table is copied and each keeps its triggers.
PostgreSQL adds the columns, then the CHECKs; adding a column with a default fires no row trigger, so finalized
invoices stay as they were. The expression is frozen here; billing/models.py declares the same
(tests/billing/test_migration_0009.py compares them).

Going back to 0008 is refused while any usage record says the cache served it a prompt token: a ledger before 0009
cannot hold it, and a migration never drops what a record says. Invoice lines only sum usage records, which are
append-only, so none of them holds a count then either.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

TABLES = ("usage_records", "invoice_lines", "invoice_line_request_kinds")
_CACHED = "cached_prompt_tokens >= 0 AND cached_prompt_tokens <= prompt_tokens"
# (table, constraint, expression): the CHECKs this revision installs
CHECKS = tuple((table, f"ck_{table}_cached_prompt_tokens", _CACHED) for table in TABLES)


def upgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    for table, constraint, expression in CHECKS:
        if postgresql:
            column = sa.Column("cached_prompt_tokens", sa.BigInteger(), nullable=False, server_default="0")
            op.add_column(table, column)
            op.create_check_constraint(op.f(constraint), table, expression)
            continue
        op.execute(
            f"ALTER TABLE {table} ADD COLUMN cached_prompt_tokens BIGINT DEFAULT 0 NOT NULL "
            f"CONSTRAINT {constraint} CHECK ({expression})"
        )


def downgrade() -> None:
    bind = op.get_bind()
    where = "cached_prompt_tokens > 0"
    served = bind.execute(sa.text(f"SELECT count(*) FROM usage_records WHERE {where}")).scalar_one()
    if served:
        raise RuntimeError(
            f"revision 0009: {served} usage record(s) say the prefix cache served prompt tokens; a ledger before 0009 "
            f"cannot hold them, and a migration never drops what a record says (SELECT * FROM usage_records WHERE "
            f"{where})"
        )
    for table, constraint, _ in reversed(CHECKS):
        if bind.dialect.name == "postgresql":
            op.drop_constraint(op.f(constraint), table, type_="check")
        op.drop_column(table, "cached_prompt_tokens")
