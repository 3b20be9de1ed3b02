"""Typed SQLAlchemy 2 models of the ledger.

The migrations under ``migrations/`` create exactly these tables plus the
triggers that make usage, idle records, prices, conflicts and credit notes
append-only and finalized invoices immutable (see ``migrations/versions``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from billing.checks import (
    CACHED_PROMPT_TOKENS,
    IDLE_DEVICE_ID_OF_UNIT,
    PERIOD_FORMAT,
    USAGE_ONE_OF,
    USAGE_RULES,
    one_of,
)
from billing.period import US_PER_MINUTE
from billing.records import (
    DEFAULT_CLASS,
    MAX_NUM_UNITS,
    MAX_RECORD_WALL_US,
    MAX_TIME_US,
    MAX_TOKENS,
    Door,
    RequestKind,
    Unit,
)

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments an INTEGER PRIMARY KEY (the rowid alias).
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")


class Role(StrEnum):
    TENANT = "tenant"
    ADMIN = "admin"


class InvoiceStatus(StrEnum):
    DRAFT = "draft"
    FINALIZED = "finalized"
    VOID = "void"


class LineKind(StrEnum):
    USAGE = "usage"
    SLA_CREDIT = "sla_credit"


class RecordKind(StrEnum):
    USAGE = "usage"
    IDLE = "idle"


# Bounds the database enforces (migration 0003; the CHECK expressions are billing/checks.py's).
MAX_PRICE_MICROS = 1_000_000_000  # 1,000 currency units per unit·second: far above any real price
# Classes of service and tenant policies (migration 0005).
MAX_CLASS_BUDGET_MS = 86_400_000
MAX_PRIORITY = 100
MAX_WEIGHT = 1000
PPM = 1_000_000


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {int: BigInteger, dict[str, Any]: JSON}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    created_at_us: Mapped[int]


class ApiKey(Base):
    __tablename__ = "api_keys"
    __table_args__ = (
        CheckConstraint(one_of("role", Role), name="role"),
        CheckConstraint("role = 'admin' OR tenant_id IS NOT NULL", name="tenant_key_has_tenant"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int | None] = mapped_column(Integer, ForeignKey("tenants.id"), index=True)
    role: Mapped[str] = mapped_column(String(16))
    key_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    key_prefix: Mapped[str] = mapped_column(String(16))
    created_at_us: Mapped[int]
    revoked_at_us: Mapped[int | None]


class UsageRow(Base):
    """One admitted call; append-only, at most one row per call_id."""

    __tablename__ = "usage_records"
    __table_args__ = (
        *(CheckConstraint(sql, name=column) for column, sql in USAGE_ONE_OF.items()),  # request_kind 0007, door 0008
        CheckConstraint("num_units > 0", name="num_units_positive"),
        CheckConstraint("unit_us >= 0 AND prompt_tokens >= 0 AND completion_tokens >= 0", name="non_negative"),
        CheckConstraint("finished_at_us >= received_at_us", name="finished_after_received"),
        CheckConstraint(f"num_units <= {MAX_NUM_UNITS}", name="num_units_range"),
        CheckConstraint(f"unit_us <= num_units * {MAX_RECORD_WALL_US}", name="unit_us_range"),
        CheckConstraint(f"prompt_tokens <= {MAX_TOKENS} AND completion_tokens <= {MAX_TOKENS}", name="tokens_range"),
        *(CheckConstraint(sql, name=name) for name, sql in USAGE_RULES.items()),  # times 0003, rules 0004, cache 0009
        Index(None, "tenant_id", "finished_at_us", "id"),
        Index(None, "finished_at_us", "id"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    call_id: Mapped[str] = mapped_column(String(128), unique=True)  # the call's, made by its replica
    request_id: Mapped[str] = mapped_column(String(128), server_default="")  # the caller's; reusable
    tenant_id: Mapped[int] = mapped_column(Integer, ForeignKey("tenants.id"))
    labels: Mapped[dict[str, Any]]
    cost_center: Mapped[str | None] = mapped_column(String(128), index=True)
    team: Mapped[str | None] = mapped_column(String(128), index=True)
    model: Mapped[str] = mapped_column(String(128))
    device_kind: Mapped[str] = mapped_column(String(8))
    device_id: Mapped[str] = mapped_column(String(128))
    unit: Mapped[str] = mapped_column(String(8))
    num_units: Mapped[int]
    unit_us: Mapped[int]
    prompt_tokens: Mapped[int]
    completion_tokens: Mapped[int]
    received_at_us: Mapped[int]
    dispatched_at_us: Mapped[int]
    first_token_at_us: Mapped[int | None]
    finished_at_us: Mapped[int]
    deadline_at_us: Mapped[int]
    deadline_met: Mapped[bool] = mapped_column(Boolean)
    outcome: Mapped[str] = mapped_column(String(32))
    payload_digest: Mapped[str] = mapped_column(String(64))
    ingested_at_us: Mapped[int]
    service_class: Mapped[str] = mapped_column(String(32), server_default=DEFAULT_CLASS)
    request_kind: Mapped[str] = mapped_column(String(32), server_default=RequestKind.PLAIN.value)  # rows before: plain
    door: Mapped[str] = mapped_column(String(16), server_default=Door.GRPC.value)  # migration 0008; rows before: grpc
    cached_prompt_tokens: Mapped[int] = mapped_column(server_default="0")  # migration 0009; rows before: none served
    weight_dtype: Mapped[str] = mapped_column(String(16), server_default="")  # migration 0010; rows before: unknown


class IdleRow(Base):
    """Idle device time for one device and UTC minute; append-only."""

    __tablename__ = "idle_records"
    __table_args__ = (
        CheckConstraint(one_of("unit", Unit), name="unit"),
        CheckConstraint("num_units > 0", name="num_units_positive"),
        CheckConstraint("idle_unit_us >= 0 AND idle_unit_us <= wall_unit_us", name="idle_within_wall"),
        CheckConstraint(f"num_units <= {MAX_NUM_UNITS}", name="num_units_range"),
        CheckConstraint(f"minute_start_us >= 0 AND minute_start_us < {MAX_TIME_US}", name="minute_range"),
        CheckConstraint(f"wall_unit_us >= 1 AND wall_unit_us <= num_units * {US_PER_MINUTE}", name="wall_range"),
        CheckConstraint(IDLE_DEVICE_ID_OF_UNIT, name="device_id_of_unit"),
        Index(None, "minute_start_us", "device_id"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    record_id: Mapped[str] = mapped_column(String(256), unique=True)
    device_id: Mapped[str] = mapped_column(String(128))
    unit: Mapped[str] = mapped_column(String(8))
    num_units: Mapped[int]
    minute_start_us: Mapped[int]
    idle_unit_us: Mapped[int]
    wall_unit_us: Mapped[int]
    payload_digest: Mapped[str] = mapped_column(String(64))
    ingested_at_us: Mapped[int]


class UsageConflict(Base):
    """A record that reused a stored id with a different payload; never applied."""

    __tablename__ = "usage_conflicts"
    __table_args__ = (
        CheckConstraint(one_of("record_kind", RecordKind), name="record_kind"),
        UniqueConstraint("record_kind", "record_id", "rejected_digest"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    record_kind: Mapped[str] = mapped_column(String(8))
    record_id: Mapped[str] = mapped_column(String(256))
    stored_digest: Mapped[str] = mapped_column(String(64))
    rejected_digest: Mapped[str] = mapped_column(String(64))
    rejected_payload: Mapped[dict[str, Any]]  # a usage record under its frozen zq.usage.v1 keys (records.py)
    detected_at_us: Mapped[int]


class Price(Base):
    """A price version: micro-units of currency per unit·second, in force from effective_from_us."""

    __tablename__ = "prices"
    __table_args__ = (
        CheckConstraint(one_of("unit", Unit), name="unit"),
        CheckConstraint("price_micros >= 0", name="price_non_negative"),
        CheckConstraint(f"price_micros <= {MAX_PRICE_MICROS}", name="price_range"),
        CheckConstraint("length(currency) = 3", name="currency_code"),
        UniqueConstraint("model", "unit", "service_class", "effective_from_us"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(128))
    unit: Mapped[str] = mapped_column(String(8))
    service_class: Mapped[str] = mapped_column(String(32), server_default="")  # '' = classes without their own
    price_micros: Mapped[int]
    currency: Mapped[str] = mapped_column(String(3))
    effective_from_us: Mapped[int]
    created_at_us: Mapped[int]


class ServiceClass(Base):
    """An operator's class of service; never deleted, and its name and credit rule never change (migration 0005)."""

    __tablename__ = "service_classes"
    __table_args__ = (
        CheckConstraint("length(name) >= 1", name="name_not_empty"),
        CheckConstraint(
            f"min_budget_ms >= 1 AND max_budget_ms >= min_budget_ms AND max_budget_ms <= {MAX_CLASS_BUDGET_MS}",
            name="budget_range",
        ),
        CheckConstraint(f"priority >= 0 AND priority <= {MAX_PRIORITY}", name="priority_range"),
        CheckConstraint(f"credit_ppm >= 0 AND credit_ppm <= {PPM}", name="credit_range"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(32), unique=True)
    min_budget_ms: Mapped[int]
    max_budget_ms: Mapped[int]
    priority: Mapped[int] = mapped_column(Integer)  # higher is admitted first under overload
    credit_ppm: Mapped[int] = mapped_column(Integer)  # share of a missed call's charge credited, per million
    created_at_us: Mapped[int]


class TenantPolicy(Base):
    """A tenant's weight in fair share and its optional caps; a tenant without a row has weight 1 and no caps."""

    __tablename__ = "tenant_policies"
    __table_args__ = (
        CheckConstraint(f"weight >= 1 AND weight <= {MAX_WEIGHT}", name="weight_range"),
        CheckConstraint(
            "(device_us_per_month IS NULL OR device_us_per_month > 0) AND "
            "(spend_micros_per_month IS NULL OR spend_micros_per_month > 0) AND "
            "(calls_per_s IS NULL OR calls_per_s > 0)",
            name="caps_positive",
        ),
    )

    tenant_id: Mapped[int] = mapped_column(Integer, ForeignKey("tenants.id"), primary_key=True)
    weight: Mapped[int] = mapped_column(Integer)
    device_us_per_month: Mapped[int | None]
    spend_micros_per_month: Mapped[int | None]
    calls_per_s: Mapped[int | None] = mapped_column(Integer)
    updated_at_us: Mapped[int]


class Invoice(Base):
    __tablename__ = "invoices"
    __table_args__ = (
        CheckConstraint(one_of("status", InvoiceStatus), name="status"),
        CheckConstraint("length(currency) = 3", name="currency_code"),
        CheckConstraint(PERIOD_FORMAT, name="period_format"),
        # At most one draft or finalized invoice per tenant and month.
        Index(
            "ix_invoices_open_tenant_period",
            "tenant_id",
            "period",
            unique=True,
            sqlite_where="status <> 'void'",
            postgresql_where="status <> 'void'",
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(Integer, ForeignKey("tenants.id"))
    period: Mapped[str] = mapped_column(String(7))
    status: Mapped[str] = mapped_column(String(16))
    currency: Mapped[str] = mapped_column(String(3))
    total_micros: Mapped[int]
    period_start_us: Mapped[int]
    period_end_us: Mapped[int]
    created_at_us: Mapped[int]
    refreshed_at_us: Mapped[int]
    finalized_at_us: Mapped[int | None]
    voided_at_us: Mapped[int | None]


class InvoiceLine(Base):
    __tablename__ = "invoice_lines"
    __table_args__ = (
        CheckConstraint(one_of("kind", LineKind), name="kind"),
        CheckConstraint(
            "(kind = 'usage' AND amount_micros >= 0) OR (kind = 'sla_credit' AND amount_micros <= 0)",
            name="amount_sign",
        ),
        UniqueConstraint("invoice_id", "position"),
        CheckConstraint(CACHED_PROMPT_TOKENS, name="cached_prompt_tokens"),  # migration 0009
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    invoice_id: Mapped[int] = mapped_column(Integer, ForeignKey("invoices.id"))
    position: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(String(128))
    unit: Mapped[str] = mapped_column(String(8))
    service_class: Mapped[str] = mapped_column(String(32), server_default=DEFAULT_CLASS)
    price_id: Mapped[int] = mapped_column(Integer, ForeignKey("prices.id"))
    price_micros: Mapped[int]
    usage_from_us: Mapped[int]
    usage_to_us: Mapped[int]
    num_requests: Mapped[int]
    unit_us: Mapped[int]
    prompt_tokens: Mapped[int]
    completion_tokens: Mapped[int]
    amount_micros: Mapped[int]
    cached_prompt_tokens: Mapped[int] = mapped_column(server_default="0")  # migration 0009; of prompt_tokens


class InvoiceLineRequestKind(Base):
    """One invoice line's usage of one request kind (migration 0007), frozen with its invoice like the line. A line's
    kinds sum to it, amount_micros too: the line's amount split by unit·µs, in integers (billing/invoice_kinds.py)."""

    __tablename__ = "invoice_line_request_kinds"
    __table_args__ = (
        CheckConstraint(one_of("request_kind", RequestKind), name="request_kind"),
        CheckConstraint(
            "num_requests >= 1 AND unit_us >= 0 AND prompt_tokens >= 0 AND completion_tokens >= 0", name="usage"
        ),
        ForeignKeyConstraint(  # a line's kinds go with it (a draft's lines are rebuilt on every refresh)
            ["invoice_id", "position"], ["invoice_lines.invoice_id", "invoice_lines.position"], ondelete="CASCADE"
        ),
        UniqueConstraint("invoice_id", "position", "request_kind"),
        CheckConstraint(CACHED_PROMPT_TOKENS, name="cached_prompt_tokens"),  # migration 0009
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    invoice_id: Mapped[int] = mapped_column(Integer)
    position: Mapped[int] = mapped_column(Integer)  # the line's
    request_kind: Mapped[str] = mapped_column(String(32))
    num_requests: Mapped[int]
    unit_us: Mapped[int]
    prompt_tokens: Mapped[int]
    completion_tokens: Mapped[int]
    amount_micros: Mapped[int]
    cached_prompt_tokens: Mapped[int] = mapped_column(server_default="0")  # migration 0009; of prompt_tokens


class CreditNote(Base):
    """The only correction of a finalized invoice; append-only."""

    __tablename__ = "credit_notes"
    __table_args__ = (
        CheckConstraint("amount_micros > 0", name="amount_positive"),
        CheckConstraint("length(currency) = 3", name="currency_code"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    invoice_id: Mapped[int] = mapped_column(Integer, ForeignKey("invoices.id"), index=True)
    amount_micros: Mapped[int]
    currency: Mapped[str] = mapped_column(String(3))
    reason: Mapped[str] = mapped_column(String(500))
    created_at_us: Mapped[int]


class LedgerSecret(Base):
    """Secrets of this ledger that never leave the server: `page_token` signs QueryUsage page tokens
    (billing/page_tokens.py). Made by migration 0003; a ledger without one makes it on first use."""

    __tablename__ = "ledger_secrets"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    secret: Mapped[str] = mapped_column(String(64))
    created_at_us: Mapped[int]
