"""usage_records.door: which of the replica's doors a call came through (issue 32).

- usage_records.door: 'grpc' (the Inference service's Generate) or 'http' (the OpenAI- and Anthropic-compatible
  HTTP API). NOT NULL, server default 'grpc': every row written before this revision came through gRPC, the only
  door there was. Enforced by ck_usage_records_door on both databases. A record's door is part of its payload
  digest only when it is not grpc (billing/records.py), so a row stored before and shipped again after is still a
  DUPLICATE, and the same call_id with another door is a CONFLICT.

The same admission, engine and meter stand behind both doors: the door labels a record's device time for
chargeback and prices nothing, so invoices are what they were.

SQLite adds the column in place (ALTER TABLE ... ADD COLUMN, its CHECK in the column's definition, as 0007 does),
so usage_records is not copied and keeps its triggers (append-only from 0001, bounds from 0003, cross-column rules
from 0004). PostgreSQL adds the column, then the CHECK. The expression is frozen here; billing/models.py declares
the same (tests/billing/test_migration_0008.py compares them).

Going back to 0007 is refused while any usage record names a door other than grpc: a ledger before 0008 cannot
hold it, and a migration never drops what decides money.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-18
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

DOORS = ("grpc", "http")
# (table, constraint, expression): the CHECK this revision installs
CHECKS = (("usage_records", "ck_usage_records_door", f"door IN ({', '.join(map(repr, DOORS))})"),)
_USAGE_DOOR = CHECKS[0][2]


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.add_column("usage_records", sa.Column("door", sa.String(length=16), nullable=False, server_default="grpc"))
        op.create_check_constraint(op.f("ck_usage_records_door"), "usage_records", _USAGE_DOOR)
        return
    op.execute(
        "ALTER TABLE usage_records ADD COLUMN door VARCHAR(16) DEFAULT 'grpc' NOT NULL "
        f"CONSTRAINT ck_usage_records_door CHECK ({_USAGE_DOOR})"
    )


def downgrade() -> None:
    bind = op.get_bind()
    where = "door <> 'grpc'"
    doored = bind.execute(sa.text(f"SELECT count(*) FROM usage_records WHERE {where}")).scalar_one()
    if doored:
        raise RuntimeError(
            f"revision 0008: {doored} usage record(s) name a door other than grpc; a ledger before 0008 cannot hold "
            f"them, and a migration never drops what decides money (SELECT * FROM usage_records WHERE {where})"
        )
    if bind.dialect.name == "postgresql":
        op.drop_constraint(op.f("ck_usage_records_door"), "usage_records", type_="check")
    op.drop_column("usage_records", "door")
