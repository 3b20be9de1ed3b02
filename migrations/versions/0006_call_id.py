"""usage_records: `call_id` is the call's own id, `request_id` the caller's (issue 30: one name per concept).

Renames usage_records.request_id (the replica's id of the admitted call, unique) to call_id, and
usage_records.client_request_id (the caller's request_id) to request_id; the unique constraint follows
(uq_usage_records_request_id becomes uq_usage_records_call_id). Values, payload digests and the rows of
usage_conflicts are not touched: a record's digest is computed over its frozen zq.usage.v1 keys
(billing/records.py), so a record stored before this revision and shipped again after it is still a DUPLICATE.

No trigger, trigger function or CHECK of 0001-0005 names either column (the append-only function reads only
TG_TABLE_NAME and TG_OP), so none has to be recreated. Both databases rename the columns in place
(ALTER TABLE ... RENAME COLUMN); PostgreSQL renames the constraint in place too. SQLite cannot rename a
constraint: the table is copied (Alembic's batch mode),
which drops its triggers (append-only from 0001, bounds from 0003, cross-column rules from 0004), so their SQL
is read from sqlite_master first and run again on the copy, as 0005 does for prices. Nothing references
usage_records by foreign key; env.py's foreign_key_check still runs before the commit.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-09
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# (old name, new name), applied in this order on upgrade and reversed on downgrade: `request_id` is free
# only once the call's id has left it
_RENAMES = (("request_id", "call_id"), ("client_request_id", "request_id"))


def _sqlite_triggers_of(table: str) -> list[str]:
    rows = op.get_bind().execute(
        sa.text("SELECT sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = :t ORDER BY name"), {"t": table}
    )
    return [row[0] for row in rows]


def _rename(renames: tuple[tuple[str, str], ...], unique_from: str, unique_to: str) -> None:
    for old, new in renames:  # in place on both: SQLite (3.25+) rewrites the table's SQL and its triggers'
        op.execute(f"ALTER TABLE usage_records RENAME COLUMN {old} TO {new}")
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            f"ALTER TABLE usage_records RENAME CONSTRAINT {op.f('uq_usage_records_' + unique_from)} "
            f"TO {op.f('uq_usage_records_' + unique_to)}"
        )
        return
    # the copy is made after the renames: batch mode carries columns over by the names they had when it began
    triggers = _sqlite_triggers_of("usage_records")
    with op.batch_alter_table("usage_records", recreate="always") as batch:
        batch.drop_constraint(op.f("uq_usage_records_" + unique_from), type_="unique")
        batch.create_unique_constraint(op.f("uq_usage_records_" + unique_to), [unique_to])
    for sql in triggers:
        op.execute(sql)


def upgrade() -> None:
    _rename(_RENAMES, "request_id", "call_id")


def downgrade() -> None:
    _rename(tuple((new, old) for old, new in reversed(_RENAMES)), "call_id", "request_id")
