"""Idempotent ingest of usage and idle records, and paginated usage queries.

Idempotency is decided inside the caller's transaction, by the insert itself:
``INSERT … ON CONFLICT DO NOTHING RETURNING id`` and then, for the ids that were
not inserted, a comparison of payload digests with the stored row.  A replay
of an identical record is a *duplicate* (and counts as delivered); the same
id with a different payload is a *conflict*: recorded in ``usage_conflicts``,
logged loudly, never applied.  No id is ever claimed before its row is written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import structlog
from sqlalchemy import Table, select, tuple_
from sqlalchemy.orm import Session

from billing.bulk import dialect_insert, insert_new, stored_digests
from billing.errors import InvalidArgument, UnknownTenant
from billing.models import IdleRow, RecordKind, Tenant, UsageConflict, UsageRow
from billing.page_tokens import decode_page_token, encode_page_token, page_token_key
from billing.period import now_us as clock_us
from billing.records import (
    CONVENTIONAL_LABELS,
    MAX_INT64,
    IdleRecord,
    UsageRecord,
    check_tenant_name,
    check_text,
    freeze_labels,
)

log = structlog.get_logger(__name__)
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1_000


class IngestStatus(StrEnum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # already stored with the same payload: delivered
    CONFLICT = "conflict"  # already stored with a different payload: rejected, recorded


@dataclass(frozen=True, slots=True)
class IngestResult:
    record_id: str
    status: IngestStatus
    stored_digest: str

    @property
    def delivered(self) -> bool:
        """True when the sender may forget the record (accepted or duplicate)."""
        return self.status is not IngestStatus.CONFLICT


def tenant_ids(session: Session, names: set[str], *, field: str = "tenant") -> dict[str, int]:
    """The id of each named tenant; InvalidRecord for a name no tenant could have, UnknownTenant for one
    that does not exist (both before any name reaches the database)."""
    for name in sorted(names, key=str):
        check_tenant_name(field, name)
    found = dict(session.execute(select(Tenant.name, Tenant.id).where(Tenant.name.in_(names))).all())
    missing = sorted(names - found.keys())
    if missing:
        raise UnknownTenant(missing[0], field=field)
    return found


def _usage_row(record: UsageRecord, tenant_id: int, digest: str, now_us: int) -> dict[str, Any]:
    row = record.to_payload()
    del row["tenant"]
    row.update(
        tenant_id=tenant_id,
        cost_center=record.cost_center,
        team=record.team,
        payload_digest=digest,
        ingested_at_us=now_us,
    )
    return row


def ingest_usage(session: Session, records: Sequence[UsageRecord], *, now_us: int | None = None) -> list[IngestResult]:
    """Store each usage record at most once; one result per record, in input order.

    Raises :class:`UnknownTenant` (before writing anything) if a record names a
    tenant that does not exist.  Never commits.
    """
    if not records:
        return []
    now_us = clock_us() if now_us is None else now_us
    tenants = tenant_ids(session, {record.tenant for record in records})
    digests = [record.payload_digest() for record in records]
    rows = {
        record.call_id: _usage_row(record, tenants[record.tenant], digest, now_us)
        for record, digest in reversed(list(zip(records, digests, strict=True)))  # first occurrence wins
    }
    return _ingest(session, UsageRow.__table__, "call_id", RecordKind.USAGE, records, digests, rows, now_us)


def ingest_idle(session: Session, records: Sequence[IdleRecord], *, now_us: int | None = None) -> list[IngestResult]:
    """Store each idle record at most once, with the same duplicate/conflict rules as usage."""
    if not records:
        return []
    now_us = clock_us() if now_us is None else now_us
    digests = [record.payload_digest() for record in records]
    rows = {
        record.record_id: {**record.to_payload(), "payload_digest": digest, "ingested_at_us": now_us}
        for record, digest in reversed(list(zip(records, digests, strict=True)))
    }
    return _ingest(session, IdleRow.__table__, "record_id", RecordKind.IDLE, records, digests, rows, now_us)


def _ingest(
    session: Session,
    table: Table,
    key: str,
    kind: RecordKind,
    records: Sequence[UsageRecord] | Sequence[IdleRecord],
    digests: list[str],
    rows: dict[str, dict[str, Any]],
    now_us: int,
) -> list[IngestResult]:
    # Sorted ids give concurrent overlapping batches one lock order: no deadlocks.
    ordered = [rows[record_id] for record_id in sorted(rows)]
    inserted = insert_new(session, table, key, ordered)
    stored = stored_digests(session, table, key, sorted(rows.keys() - inserted)) if len(inserted) < len(rows) else {}
    results, accepted_now = [], set()
    for record, digest in zip(records, digests, strict=True):
        record_id = getattr(record, key)
        if record_id in inserted and record_id not in accepted_now:
            accepted_now.add(record_id)
            results.append(IngestResult(record_id, IngestStatus.ACCEPTED, digest))
            continue
        # A later copy of an id inserted by this very call compares with the inserted row.
        stored_digest = rows[record_id]["payload_digest"] if record_id in inserted else stored[record_id]
        if stored_digest == digest:
            results.append(IngestResult(record_id, IngestStatus.DUPLICATE, stored_digest))
        else:
            _record_conflict(session, kind, record, stored_digest, digest, now_us)
            results.append(IngestResult(record_id, IngestStatus.CONFLICT, stored_digest))
    return results


def _record_conflict(
    session: Session,
    kind: RecordKind,
    record: UsageRecord | IdleRecord,
    stored_digest: str,
    rejected_digest: str,
    now_us: int,
) -> None:
    record_id = record.call_id if isinstance(record, UsageRecord) else record.record_id
    log.error(
        "ledger.conflict",
        record_kind=kind.value,
        record_id=record_id,
        stored_digest=stored_digest,
        rejected_digest=rejected_digest,
    )
    statement = dialect_insert(session, UsageConflict.__table__).on_conflict_do_nothing(
        index_elements=["record_kind", "record_id", "rejected_digest"]
    )
    session.execute(
        statement,
        {
            "record_kind": kind.value,
            "record_id": record_id,
            "stored_digest": stored_digest,
            "rejected_digest": rejected_digest,
            # usage under its frozen v1 keys, as digested: rows written before the rename read the same way
            "rejected_payload": record.to_v1_payload() if isinstance(record, UsageRecord) else record.to_payload(),
            "detected_at_us": now_us,
        },
    )


@dataclass(frozen=True, slots=True)
class UsagePage:
    records: list[UsageRecord]
    next_page_token: str | None


def query_usage(
    session: Session,
    *,
    start_us: int,
    end_us: int,
    tenant: str | None = None,
    labels: Mapping[str, str] | None = None,
    model: str | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    page_token: str | None = None,
) -> UsagePage:
    """Usage finished in [start_us, end_us), oldest first, filtered and paginated by keyset.

    ``page_token`` is opaque and signed by this ledger (billing/page_tokens.py); it is only valid with the
    filters it was issued for.
    """
    _check_query(start_us, end_us, page_size)
    if model is not None:
        check_text("model", model)
    labels = dict(freeze_labels(labels or {}))
    fingerprint = filter_fingerprint(start_us, end_us, tenant, labels, model)
    query = (
        select(UsageRow, Tenant.name)
        .join(Tenant, Tenant.id == UsageRow.tenant_id)
        .where(UsageRow.finished_at_us >= start_us, UsageRow.finished_at_us < end_us)
        .order_by(UsageRow.finished_at_us, UsageRow.id)
        .limit(page_size + 1)
    )
    if tenant is not None:
        query = query.where(UsageRow.tenant_id == tenant_ids(session, {tenant})[tenant])
    if model is not None:
        query = query.where(UsageRow.model == model)
    for key, value in sorted(labels.items()):
        column = getattr(UsageRow, key) if key in CONVENTIONAL_LABELS else UsageRow.labels[key].as_string()
        query = query.where(column == value)
    if page_token:
        after = decode_page_token(page_token_key(session), page_token, fingerprint)
        query = query.where(tuple_(UsageRow.finished_at_us, UsageRow.id) > tuple_(*after))
    rows = session.execute(query).all()
    next_token = None
    if len(rows) > page_size:
        rows = rows[:page_size]
        last = rows[-1][0]
        next_token = encode_page_token(page_token_key(session), fingerprint, last.finished_at_us, last.id)
    return UsagePage([_to_record(row, name) for row, name in rows], next_token)


def _check_query(start_us: int, end_us: int, page_size: int) -> None:
    for name, value in (("start_us", start_us), ("end_us", end_us), ("page_size", page_size)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT64:
            raise InvalidArgument(f"{name} must be an integer in [0, 2^63-1], got {value!r}", field=name)
    if end_us <= start_us:
        raise InvalidArgument("end_us must be after start_us", field="end_us")
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise InvalidArgument(f"page_size must be in [1, {MAX_PAGE_SIZE}], got {page_size}", field="page_size")


def filter_fingerprint(*filters: object) -> str:
    """A short digest of a listing's filters, signed into its page tokens: a token only pages the listing it
    came from."""
    encoded = json.dumps(filters, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(encoded.encode()).hexdigest()[:16]


def _to_record(row: UsageRow, tenant: str) -> UsageRecord:
    return UsageRecord(
        call_id=row.call_id,
        tenant=tenant,
        labels=row.labels,
        model=row.model,
        device_kind=row.device_kind,
        device_id=row.device_id,
        unit=row.unit,
        num_units=row.num_units,
        unit_us=row.unit_us,
        prompt_tokens=row.prompt_tokens,
        completion_tokens=row.completion_tokens,
        received_at_us=row.received_at_us,
        dispatched_at_us=row.dispatched_at_us,
        first_token_at_us=row.first_token_at_us,
        finished_at_us=row.finished_at_us,
        deadline_at_us=row.deadline_at_us,
        deadline_met=row.deadline_met,
        outcome=row.outcome,
        request_id=row.request_id,
        service_class=row.service_class,
        request_kind=row.request_kind,
        door=row.door,
        cached_prompt_tokens=row.cached_prompt_tokens,
        weight_dtype=row.weight_dtype,
    )
