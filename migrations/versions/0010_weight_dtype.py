"""usage_records.weight_dtype: what the replica held its decoder weights in (issue 34).

- usage_records.weight_dtype: 'int8' when the replica served the model quantized (--quantize int8), else the
  checkpoint's dtype ('bfloat16', 'float32', ...). NOT NULL, server default '' (unknown): a row written before this
  revision came from a replica that did not say, and the ledger cannot tell after the fact (no replica quantized
  then, but the checkpoint's dtype was never recorded either). '' is also what a record from a sender before this
  field carries (an older outbox row lacks the key; an older metering client leaves protobuf's empty string), so a
  stored row and the record it came from read the same. A record's weight_dtype is part of its payload digest only
  when it is not '' (billing/records.py), so a row stored before and shipped again after is still a DUPLICATE, and
  the same call_id with another dtype is a CONFLICT.

The dtype labels a record's device time for audit and chargeback and prices nothing: a price is per model name, so
invoices are what they were. Its format (at most 16 characters of [a-z0-9_], a letter first) is the record's rule,
not a CHECK: it is not an enumeration, so a new quantization needs no migration to be recorded.

Both databases add the column in place (ALTER TABLE ... ADD COLUMN, as 0007 to 0009 do), so usage_records is not
copied and keeps its triggers (append-only from 0001, bounds from 0003, cross-column rules from 0004).

Going back to 0009 is refused while any usage record names a weight dtype: a ledger before 0010 cannot hold it,
and a migration never drops what a record says. Every record a replica makes after this revision names one, so in
practice only a ledger that has taken no new usage goes back.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("usage_records", sa.Column("weight_dtype", sa.String(length=16), nullable=False, server_default=""))


def downgrade() -> None:
    bind = op.get_bind()
    where = "weight_dtype <> ''"
    named = bind.execute(sa.text(f"SELECT count(*) FROM usage_records WHERE {where}")).scalar_one()
    if named:
        raise RuntimeError(
            f"revision 0010: {named} usage record(s) name a weight dtype; a ledger before 0010 cannot hold them, and "
            f"a migration never drops what a record says (SELECT * FROM usage_records WHERE {where})"
        )
    op.drop_column("usage_records", "weight_dtype")
