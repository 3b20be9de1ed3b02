"""usage_records.client_request_id: the caller's request_id beside the call's own.

A usage record's request_id is now made by the replica for each admitted call, so a caller that sends a
request_id again is billed for each call, as its own record; the caller's id is kept beside it. Rows written
before this revision get '' (their request_id was the caller's).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a plain ADD COLUMN, not a batch copy: on SQLite a copy would drop the append-only triggers
    op.add_column("usage_records", sa.Column("client_request_id", sa.String(128), nullable=False,
                                             server_default=""))


def downgrade() -> None:
    op.drop_column("usage_records", "client_request_id")
