"""Initial ledger: tenants, keys, usage and idle records, prices, invoices, credit notes.

Besides the tables this revision installs the triggers that make the ledger
append-only (usage_records, idle_records, usage_conflicts, prices,
credit_notes refuse UPDATE and DELETE) and finalized invoices immutable
(invoices: a finalized invoice may only be voided; a void one not touched;
invoice_lines: no write unless the invoice is a draft; credit_notes: only
against a finalized invoice).  The trigger SQL lives here, frozen with the
revision, on purpose.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigIntPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
APPEND_ONLY = ("usage_records", "idle_records", "usage_conflicts", "prices", "credit_notes")


def upgrade() -> None:
    _create_identity_tables()
    _create_usage_table()
    _create_idle_and_conflict_tables()
    _create_price_and_invoice_tables()
    _create_invoice_line_and_credit_tables()
    if op.get_bind().dialect.name == "postgresql":
        _create_postgresql_triggers()
    else:
        _create_sqlite_triggers()


def downgrade() -> None:
    for table in ("invoice_lines", "credit_notes", "invoices", "prices", "usage_conflicts"):
        op.drop_table(table)
    for table in ("idle_records", "usage_records", "api_keys", "tenants"):
        op.drop_table(table)
    if op.get_bind().dialect.name == "postgresql":
        for function in _POSTGRESQL_FUNCTIONS:
            op.execute(f"DROP FUNCTION IF EXISTS {function}()")


def _create_identity_tables() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("created_at_us", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("key_sha256", sa.String(64), nullable=False),
        sa.Column("key_prefix", sa.String(16), nullable=False),
        sa.Column("created_at_us", sa.BigInteger(), nullable=False),
        sa.Column("revoked_at_us", sa.BigInteger(), nullable=True),
        sa.CheckConstraint("role IN ('tenant', 'admin')", name=op.f("ck_api_keys_role")),
        sa.CheckConstraint(
            "role = 'admin' OR tenant_id IS NOT NULL", name=op.f("ck_api_keys_tenant_key_has_tenant")
        ),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_sha256", name=op.f("uq_api_keys_key_sha256")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])


def _create_usage_table() -> None:
    op.create_table(
        "usage_records",
        sa.Column("id", BigIntPK, nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("cost_center", sa.String(128), nullable=True),
        sa.Column("team", sa.String(128), nullable=True),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("device_kind", sa.String(8), nullable=False),
        sa.Column("device_id", sa.String(128), nullable=False),
        sa.Column("unit", sa.String(8), nullable=False),
        *[sa.Column(name, sa.BigInteger(), nullable=False) for name in (
            "num_units", "unit_us", "prompt_tokens", "completion_tokens",
            "received_at_us", "dispatched_at_us")],
        sa.Column("first_token_at_us", sa.BigInteger(), nullable=True),
        sa.Column("finished_at_us", sa.BigInteger(), nullable=False),
        sa.Column("deadline_at_us", sa.BigInteger(), nullable=False),
        sa.Column("deadline_met", sa.Boolean(), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("payload_digest", sa.String(64), nullable=False),
        sa.Column("ingested_at_us", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("device_kind IN ('cpu', 'cuda')", name=op.f("ck_usage_records_device_kind")),
        sa.CheckConstraint("unit IN ('sm_us', 'core_us')", name=op.f("ck_usage_records_unit")),
        sa.CheckConstraint(
            "outcome IN ('ok', 'cancelled', 'deadline_exceeded', 'error')",
            name=op.f("ck_usage_records_outcome"),
        ),
        sa.CheckConstraint("num_units > 0", name=op.f("ck_usage_records_num_units_positive")),
        sa.CheckConstraint(
            "unit_us >= 0 AND prompt_tokens >= 0 AND completion_tokens >= 0",
            name=op.f("ck_usage_records_non_negative"),
        ),
        sa.CheckConstraint(
            "finished_at_us >= received_at_us", name=op.f("ck_usage_records_finished_after_received")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_records_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_records")),
        sa.UniqueConstraint("request_id", name=op.f("uq_usage_records_request_id")),
    )
    op.create_index(op.f("ix_usage_records_cost_center"), "usage_records", ["cost_center"])
    op.create_index(op.f("ix_usage_records_team"), "usage_records", ["team"])
    op.create_index(op.f("ix_usage_records_finished_at_us_id"), "usage_records", ["finished_at_us", "id"])
    op.create_index(
        op.f("ix_usage_records_tenant_id_finished_at_us_id"),
        "usage_records",
        ["tenant_id", "finished_at_us", "id"],
    )


def _create_idle_and_conflict_tables() -> None:
    op.create_table(
        "idle_records",
        sa.Column("id", BigIntPK, nullable=False),
        sa.Column("record_id", sa.String(256), nullable=False),
        sa.Column("device_id", sa.String(128), nullable=False),
        sa.Column("unit", sa.String(8), nullable=False),
        *[sa.Column(name, sa.BigInteger(), nullable=False) for name in (
            "num_units", "minute_start_us", "idle_unit_us", "wall_unit_us")],
        sa.Column("payload_digest", sa.String(64), nullable=False),
        sa.Column("ingested_at_us", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("unit IN ('sm_us', 'core_us')", name=op.f("ck_idle_records_unit")),
        sa.CheckConstraint("num_units > 0", name=op.f("ck_idle_records_num_units_positive")),
        sa.CheckConstraint(
            "idle_unit_us >= 0 AND idle_unit_us <= wall_unit_us", name=op.f("ck_idle_records_idle_within_wall")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_idle_records")),
        sa.UniqueConstraint("record_id", name=op.f("uq_idle_records_record_id")),
    )
    op.create_index(
        op.f("ix_idle_records_minute_start_us_device_id"), "idle_records", ["minute_start_us", "device_id"]
    )
    op.create_table(
        "usage_conflicts",
        sa.Column("id", BigIntPK, nullable=False),
        sa.Column("record_kind", sa.String(8), nullable=False),
        sa.Column("record_id", sa.String(256), nullable=False),
        sa.Column("stored_digest", sa.String(64), nullable=False),
        sa.Column("rejected_digest", sa.String(64), nullable=False),
        sa.Column("rejected_payload", sa.JSON(), nullable=False),
        sa.Column("detected_at_us", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("record_kind IN ('usage', 'idle')", name=op.f("ck_usage_conflicts_record_kind")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_conflicts")),
        sa.UniqueConstraint(
            "record_kind", "record_id", "rejected_digest",
            name=op.f("uq_usage_conflicts_record_kind_record_id_rejected_digest"),
        ),
    )


def _create_price_and_invoice_tables() -> None:
    op.create_table(
        "prices",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("unit", sa.String(8), nullable=False),
        sa.Column("price_micros", sa.BigInteger(), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("effective_from_us", sa.BigInteger(), nullable=False),
        sa.Column("created_at_us", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("unit IN ('sm_us', 'core_us')", name=op.f("ck_prices_unit")),
        sa.CheckConstraint("price_micros >= 0", name=op.f("ck_prices_price_non_negative")),
        sa.CheckConstraint("length(currency) = 3", name=op.f("ck_prices_currency_code")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prices")),
        sa.UniqueConstraint(
            "model", "unit", "effective_from_us", name=op.f("uq_prices_model_unit_effective_from_us")
        ),
    )
    op.create_table(
        "invoices",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("period", sa.String(7), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        *[sa.Column(name, sa.BigInteger(), nullable=False) for name in (
            "total_micros", "period_start_us", "period_end_us", "created_at_us", "refreshed_at_us")],
        sa.Column("finalized_at_us", sa.BigInteger(), nullable=True),
        sa.Column("voided_at_us", sa.BigInteger(), nullable=True),
        sa.CheckConstraint("status IN ('draft', 'finalized', 'void')", name=op.f("ck_invoices_status")),
        sa.CheckConstraint("length(currency) = 3", name=op.f("ck_invoices_currency_code")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_invoices_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_invoices")),
    )
    op.create_index(
        "ix_invoices_open_tenant_period",
        "invoices",
        ["tenant_id", "period"],
        unique=True,
        sqlite_where=sa.text("status <> 'void'"),
        postgresql_where=sa.text("status <> 'void'"),
    )


def _create_invoice_line_and_credit_tables() -> None:
    op.create_table(
        "invoice_lines",
        sa.Column("id", BigIntPK, nullable=False),
        sa.Column("invoice_id", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("unit", sa.String(8), nullable=False),
        sa.Column("price_id", sa.Integer(), nullable=False),
        *[sa.Column(name, sa.BigInteger(), nullable=False) for name in (
            "price_micros", "usage_from_us", "usage_to_us", "num_requests", "unit_us",
            "prompt_tokens", "completion_tokens", "amount_micros")],
        sa.CheckConstraint("kind IN ('usage', 'sla_credit')", name=op.f("ck_invoice_lines_kind")),
        sa.CheckConstraint(
            "(kind = 'usage' AND amount_micros >= 0) OR (kind = 'sla_credit' AND amount_micros <= 0)",
            name=op.f("ck_invoice_lines_amount_sign"),
        ),
        sa.ForeignKeyConstraint(
            ["invoice_id"], ["invoices.id"], name=op.f("fk_invoice_lines_invoice_id_invoices")
        ),
        sa.ForeignKeyConstraint(["price_id"], ["prices.id"], name=op.f("fk_invoice_lines_price_id_prices")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_invoice_lines")),
        sa.UniqueConstraint("invoice_id", "position", name=op.f("uq_invoice_lines_invoice_id_position")),
    )
    op.create_table(
        "credit_notes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("invoice_id", sa.Integer(), nullable=False),
        sa.Column("amount_micros", sa.BigInteger(), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("reason", sa.String(500), nullable=False),
        sa.Column("created_at_us", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("amount_micros > 0", name=op.f("ck_credit_notes_amount_positive")),
        sa.CheckConstraint("length(currency) = 3", name=op.f("ck_credit_notes_currency_code")),
        sa.ForeignKeyConstraint(
            ["invoice_id"], ["invoices.id"], name=op.f("fk_credit_notes_invoice_id_invoices")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_credit_notes")),
    )
    op.create_index(op.f("ix_credit_notes_invoice_id"), "credit_notes", ["invoice_id"])


# --- SQLite triggers: RAISE(ABORT) surfaces as an IntegrityError. ---------------------------

_SQLITE_INVOICE_UNCHANGED_BUT_STATUS = " AND ".join(
    f"NEW.{column} IS OLD.{column}"
    for column in (
        "id", "tenant_id", "period", "currency", "total_micros", "period_start_us",
        "period_end_us", "created_at_us", "refreshed_at_us", "finalized_at_us",
    )
)


def _sqlite_trigger(name: str, timing: str, table: str, when: str | None, message: str) -> str:
    condition = f" WHEN {when}" if when else ""
    return (
        f"CREATE TRIGGER {name} BEFORE {timing} ON {table} FOR EACH ROW{condition} "
        f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
    )


def _create_sqlite_triggers() -> None:
    for table in APPEND_ONLY:
        for timing in ("UPDATE", "DELETE"):
            op.execute(_sqlite_trigger(
                f"trg_{table}_no_{timing.lower()}", timing, table, None,
                f"{table} is append-only: {timing} refused",
            ))
    op.execute(_sqlite_trigger(
        "trg_invoices_immutable_update", "UPDATE", "invoices",
        "OLD.status = 'void' OR (OLD.status = 'finalized' AND NOT "
        f"(NEW.status = 'void' AND {_SQLITE_INVOICE_UNCHANGED_BUT_STATUS}))",
        "invoice is finalized or void: UPDATE refused",
    ))
    op.execute(_sqlite_trigger(
        "trg_invoices_immutable_delete", "DELETE", "invoices", "OLD.status <> 'draft'",
        "invoice is finalized or void: DELETE refused",
    ))
    status_of = "(SELECT status FROM invoices WHERE id = {}.invoice_id)"
    op.execute(_sqlite_trigger(
        "trg_invoice_lines_frozen_insert", "INSERT", "invoice_lines",
        f"{status_of.format('NEW')} IS NOT 'draft'", "invoice is not a draft: line INSERT refused",
    ))
    op.execute(_sqlite_trigger(
        "trg_invoice_lines_frozen_update", "UPDATE", "invoice_lines",
        f"{status_of.format('OLD')} IS NOT 'draft' OR {status_of.format('NEW')} IS NOT 'draft'",
        "invoice is not a draft: line UPDATE refused",
    ))
    op.execute(_sqlite_trigger(
        "trg_invoice_lines_frozen_delete", "DELETE", "invoice_lines",
        f"{status_of.format('OLD')} IS NOT 'draft'", "invoice is not a draft: line DELETE refused",
    ))
    op.execute(_sqlite_trigger(
        "trg_credit_notes_finalized_only", "INSERT", "credit_notes",
        f"{status_of.format('NEW')} IS NOT 'finalized'",
        "credit notes apply to finalized invoices only",
    ))


# --- PostgreSQL triggers: SQLSTATE 23001 (restrict_violation) surfaces as an IntegrityError. ---

_POSTGRESQL_FUNCTIONS = (
    "zq_refuse_change", "zq_guard_invoice", "zq_guard_invoice_line", "zq_guard_credit_note",
)

_POSTGRESQL_SQL = (
    """
    CREATE FUNCTION zq_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'restrict_violation';
    END $$
    """,
    """
    CREATE FUNCTION zq_guard_invoice() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      IF TG_OP = 'DELETE' THEN
        IF OLD.status <> 'draft' THEN
          RAISE EXCEPTION 'invoice % is %: DELETE refused', OLD.id, OLD.status
            USING ERRCODE = 'restrict_violation';
        END IF;
        RETURN OLD;
      END IF;
      IF OLD.status = 'void' OR (OLD.status = 'finalized' AND NOT (NEW.status = 'void'
          AND (to_jsonb(NEW) - 'status' - 'voided_at_us') = (to_jsonb(OLD) - 'status' - 'voided_at_us'))) THEN
        RAISE EXCEPTION 'invoice % is %: UPDATE refused', OLD.id, OLD.status
          USING ERRCODE = 'restrict_violation';
      END IF;
      RETURN NEW;
    END $$
    """,
    # FOR SHARE waits for a concurrent finalize to commit and then sees its status.
    """
    CREATE FUNCTION zq_guard_invoice_line() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE parent_status text;
    BEGIN
      IF TG_OP IN ('UPDATE', 'DELETE') THEN
        SELECT status INTO parent_status FROM invoices WHERE id = OLD.invoice_id FOR SHARE;
        IF parent_status IS DISTINCT FROM 'draft' THEN
          RAISE EXCEPTION 'invoice % is %: line % refused', OLD.invoice_id, parent_status, TG_OP
            USING ERRCODE = 'restrict_violation';
        END IF;
      END IF;
      IF TG_OP IN ('INSERT', 'UPDATE') THEN
        SELECT status INTO parent_status FROM invoices WHERE id = NEW.invoice_id FOR SHARE;
        IF parent_status IS DISTINCT FROM 'draft' THEN
          RAISE EXCEPTION 'invoice % is %: line % refused', NEW.invoice_id, parent_status, TG_OP
            USING ERRCODE = 'restrict_violation';
        END IF;
        RETURN NEW;
      END IF;
      RETURN OLD;
    END $$
    """,
    """
    CREATE FUNCTION zq_guard_credit_note() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE parent_status text;
    BEGIN
      SELECT status INTO parent_status FROM invoices WHERE id = NEW.invoice_id FOR SHARE;
      IF parent_status IS DISTINCT FROM 'finalized' THEN
        RAISE EXCEPTION 'credit notes apply to finalized invoices only (invoice % is %)',
          NEW.invoice_id, parent_status USING ERRCODE = 'restrict_violation';
      END IF;
      RETURN NEW;
    END $$
    """,
    *(
        f"CREATE TRIGGER trg_{table}_append_only BEFORE UPDATE OR DELETE ON {table} "
        "FOR EACH ROW EXECUTE FUNCTION zq_refuse_change()"
        for table in APPEND_ONLY
    ),
    "CREATE TRIGGER trg_invoices_guard BEFORE UPDATE OR DELETE ON invoices "
    "FOR EACH ROW EXECUTE FUNCTION zq_guard_invoice()",
    "CREATE TRIGGER trg_invoice_lines_guard BEFORE INSERT OR UPDATE OR DELETE ON invoice_lines "
    "FOR EACH ROW EXECUTE FUNCTION zq_guard_invoice_line()",
    "CREATE TRIGGER trg_credit_notes_finalized_only BEFORE INSERT ON credit_notes "
    "FOR EACH ROW EXECUTE FUNCTION zq_guard_credit_note()",
)


def _create_postgresql_triggers() -> None:
    for statement in _POSTGRESQL_SQL:
        op.execute(statement)
