"""Invoices per tenant and calendar month (UTC), with SLA credits and credit notes.

Lifecycle: draft → finalized → void.  A draft is (re)computed from the
ledger by :func:`create_or_refresh_draft`; doing it twice refreshes the same
draft (the database allows one non-void invoice per tenant and month).  A
finalized invoice is immutable, refused here and by database triggers; the
only correction is a credit note (or voiding it and issuing a new one).

Lines: per model, unit, class of service and price version, usage is summed
first and priced once (see :mod:`billing.pricing` for the rounding rule), each
class at its own price (or the generic one).  Requests that missed their
deadline (``deadline_met`` false) are credited their class's share of their
cost (credit_ppm; the class `standard`: all of it) on a separate negative
``sla_credit`` line, rounded once (see :mod:`billing.aggregate`).  Each line
lists its usage per request kind, its amount split over them exactly
(:mod:`billing.invoice_kinds`); the kinds change no line and no total.  Each
line and kind shows, beside its prompt tokens, those the prefix cache served
(``cached_prompt_tokens``, frozen with the line): a call that hit the cache
measured less device time, which is all that prices it; the count prices nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, insert, select, text
from sqlalchemy.orm import Session

from billing.aggregate import aggregate_usage, check_int64
from billing.errors import (
    CreditExceedsInvoice,
    CurrencyMismatch,
    InvalidArgument,
    InvoiceFinalized,
    InvoiceNotFound,
    InvoiceState,
)
from billing.invoice_kinds import KindedAggregate, RequestKindUsage, by_line, kind_rows, read_kinds
from billing.ledger import dialect_insert, tenant_ids
from billing.models import CreditNote, Invoice, InvoiceLine, InvoiceLineRequestKind, InvoiceStatus, LineKind, Tenant
from billing.period import Period, day_label, parse_period
from billing.period import now_us as clock_us
from billing.records import DEFAULT_CLASS, MAX_INT32, MAX_INT64

DEFAULT_CURRENCY = "USD"  # only for an invoice without lines
# Literal SQL, as in the partial unique index, so PostgreSQL can infer that index as the arbiter.
OPEN_INVOICE_PREDICATE = text("status <> 'void'")


@dataclass(frozen=True, slots=True)
class InvoiceLineView:
    position: int
    kind: LineKind
    model: str
    unit: str
    price_id: int
    price_micros: int
    usage_from_us: int
    usage_to_us: int
    num_requests: int
    unit_us: int
    prompt_tokens: int
    completion_tokens: int
    amount_micros: int
    service_class: str = DEFAULT_CLASS
    request_kinds: tuple[RequestKindUsage, ...] = ()  # the line per kind: they sum to it, amount included
    cached_prompt_tokens: int = 0  # of prompt_tokens, those the prefix cache served (issue 33)

    @property
    def description(self) -> str:
        what = "SLA credit: missed deadlines" if self.kind is LineKind.SLA_CREDIT else "usage"
        unit = "SM" if self.unit == "sm_us" else "core"
        of_class = "" if self.service_class == DEFAULT_CLASS else f", class {self.service_class}"
        return f"{self.model} {what} ({unit}·µs at {self.price_micros} micros per {unit}·s{of_class})"


@dataclass(frozen=True, slots=True)
class CreditNoteView:
    id: int
    invoice_id: int
    amount_micros: int
    currency: str
    reason: str
    created_at_us: int


@dataclass(frozen=True, slots=True)
class InvoiceView:
    id: int
    tenant: str
    period: str
    status: InvoiceStatus
    currency: str
    total_micros: int
    period_start_us: int
    period_end_us: int
    created_at_us: int
    refreshed_at_us: int
    finalized_at_us: int | None
    voided_at_us: int | None
    lines: tuple[InvoiceLineView, ...]
    credit_notes: tuple[CreditNoteView, ...]

    @property
    def credited_micros(self) -> int:
        return sum(note.amount_micros for note in self.credit_notes)

    @property
    def balance_micros(self) -> int:
        """What the tenant owes: the total less every credit note."""
        return self.total_micros - self.credited_micros


_STORED = ("num_requests", "unit_us", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "amount_micros")


def _line_rows(lines: list[KindedAggregate], period: str) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """The invoice's lines, and each line's rows per request kind."""
    rows: list[dict[str, object]] = []
    kinds: list[dict[str, object]] = []
    for line in sorted(lines, key=lambda a: (a.total.model, a.total.unit, a.total.service_class, a.total.from_us)):
        agg = line.total
        common = dict(
            model=agg.model,
            unit=agg.unit,
            service_class=agg.service_class,
            price_id=agg.price.id,
            price_micros=agg.price.price_micros,
            usage_from_us=agg.from_us,
            usage_to_us=agg.to_us,
        )
        rows.append(
            dict(
                common,
                kind=LineKind.USAGE.value,
                num_requests=agg.num_requests,
                unit_us=agg.unit_us,
                prompt_tokens=agg.prompt_tokens,
                cached_prompt_tokens=agg.cached_prompt_tokens,
                completion_tokens=agg.completion_tokens,
                amount_micros=agg.charge_micros,
            )
        )
        kinds += kind_rows(len(rows) - 1, LineKind.USAGE, agg.charge_micros, line.kinds)
        if agg.num_missed:
            rows.append(
                dict(
                    common,
                    kind=LineKind.SLA_CREDIT.value,
                    num_requests=agg.num_missed,
                    unit_us=agg.missed_unit_us,
                    prompt_tokens=agg.missed_prompt_tokens,
                    cached_prompt_tokens=agg.missed_cached_prompt_tokens,
                    completion_tokens=agg.missed_completion_tokens,
                    amount_micros=-agg.sla_credit_micros,
                )
            )
            kinds += kind_rows(len(rows) - 1, LineKind.SLA_CREDIT, -agg.sla_credit_micros, line.kinds)
    for position, row in enumerate(rows):
        row["position"] = position
        for name in _STORED:
            where = f"{row['model']} {row['unit']} {row['service_class']} in {period}"
            check_int64(name, row[name], where)  # type: ignore[arg-type]
    return rows, kinds  # a kind's sums are at most its line's


def _currency(lines: list[KindedAggregate], period: Period) -> str:
    currencies = sorted({line.total.price.currency for line in lines})
    if len(currencies) > 1:
        raise CurrencyMismatch(
            f"period: usage in {period.name} is priced in several currencies ({', '.join(currencies)})", field="period"
        )
    return currencies[0] if currencies else DEFAULT_CURRENCY


def _refresh(session: Session, invoice: Invoice, now_us: int) -> None:
    period = parse_period(invoice.period)
    kinded = aggregate_usage(
        session, period.start_us, period.end_us, group_by=("request_kind",), tenant_id=invoice.tenant_id
    )
    lines = by_line(kinded)
    rows, kinds = _line_rows(lines, period.name)
    currency = _currency(lines, period)
    amounts = [int(row["amount_micros"]) for row in rows]  # type: ignore[call-overload]
    total = check_int64("total", sum(amounts), period.name)
    session.execute(delete(InvoiceLineRequestKind).where(InvoiceLineRequestKind.invoice_id == invoice.id))
    session.execute(delete(InvoiceLine).where(InvoiceLine.invoice_id == invoice.id))
    if rows:
        session.execute(insert(InvoiceLine), [dict(row, invoice_id=invoice.id) for row in rows])
        session.execute(insert(InvoiceLineRequestKind), [dict(row, invoice_id=invoice.id) for row in kinds])
    invoice.currency = currency
    invoice.total_micros = total
    invoice.refreshed_at_us = now_us
    session.flush()


def create_or_refresh_draft(session: Session, tenant: str, period: str, *, now_us: int | None = None) -> InvoiceView:
    """The tenant's draft for ``period`` ('YYYY-MM', ASCII digits: the one spelling stored), created or
    recomputed from the ledger."""
    bounds = parse_period(period)
    tenant_id = tenant_ids(session, {tenant})[tenant]
    now_us = clock_us() if now_us is None else now_us
    open_invoice = (Invoice.tenant_id == tenant_id, Invoice.period == bounds.name, Invoice.status != "void")
    session.execute(
        dialect_insert(session, Invoice.__table__)
        .values(
            tenant_id=tenant_id,
            period=bounds.name,
            status=InvoiceStatus.DRAFT.value,
            currency=DEFAULT_CURRENCY,
            total_micros=0,
            period_start_us=bounds.start_us,
            period_end_us=bounds.end_us,
            created_at_us=now_us,
            refreshed_at_us=now_us,
        )
        .on_conflict_do_nothing(index_elements=["tenant_id", "period"], index_where=OPEN_INVOICE_PREDICATE)
    )
    invoice = session.scalars(
        select(Invoice).where(*open_invoice).with_for_update().execution_options(populate_existing=True)
    ).one()
    if invoice.status != InvoiceStatus.DRAFT:
        raise InvoiceFinalized(invoice.id, invoice.status)
    _refresh(session, invoice, now_us)
    return get_invoice(session, invoice.id)


def _lock(session: Session, invoice_id: int) -> Invoice:
    check_invoice_id(invoice_id)
    invoice = session.scalars(
        select(Invoice).where(Invoice.id == invoice_id).with_for_update().execution_options(populate_existing=True)
    ).first()
    if invoice is None:
        raise InvoiceNotFound(invoice_id)
    return invoice


def finalize_invoice(
    session: Session, invoice_id: int, *, now_us: int | None = None, refresh: bool = True
) -> InvoiceView:
    """Finalize a draft once its month has ended; by default recompute it from the ledger first."""
    invoice = _lock(session, invoice_id)
    now_us = clock_us() if now_us is None else now_us
    if invoice.status != InvoiceStatus.DRAFT:
        raise InvoiceFinalized(invoice.id, invoice.status)
    if now_us < invoice.period_end_us:
        raise InvoiceState(
            f"invoice_id: {invoice.period} has not ended; finalize on or after {day_label(invoice.period_end_us)}",
            field="invoice_id",
        )
    if refresh:
        _refresh(session, invoice, now_us)
    invoice.status = InvoiceStatus.FINALIZED.value
    invoice.finalized_at_us = now_us
    session.flush()
    return get_invoice(session, invoice.id)


def void_invoice(session: Session, invoice_id: int, *, now_us: int | None = None) -> InvoiceView:
    """Void a draft or finalized invoice; a new draft may then be created for the same month."""
    invoice = _lock(session, invoice_id)
    if invoice.status == InvoiceStatus.VOID:
        raise InvoiceFinalized(invoice.id, invoice.status)
    invoice.status = InvoiceStatus.VOID.value
    invoice.voided_at_us = clock_us() if now_us is None else now_us
    session.flush()
    return get_invoice(session, invoice.id)


def issue_credit_note(
    session: Session, invoice_id: int, amount_micros: int, reason: str, *, now_us: int | None = None
) -> CreditNoteView:
    """Credit part of a finalized invoice; all credit notes together may not exceed its total."""
    if not isinstance(amount_micros, int) or isinstance(amount_micros, bool) or not 0 < amount_micros <= MAX_INT64:
        raise InvalidArgument(f"amount_micros must be a positive integer, got {amount_micros!r}", field="amount_micros")
    if not isinstance(reason, str) or not 1 <= len(reason) <= 500:
        raise InvalidArgument("reason must be 1..500 characters", field="reason")
    if "\x00" in reason:
        raise InvalidArgument("reason must not contain NUL characters", field="reason")
    invoice = _lock(session, invoice_id)
    if invoice.status != InvoiceStatus.FINALIZED:
        raise InvoiceState(
            f"invoice_id: credit notes apply to finalized invoices; invoice {invoice_id} is {invoice.status}",
            field="invoice_id",
        )
    view = get_invoice(session, invoice_id)
    if amount_micros > view.balance_micros:
        raise CreditExceedsInvoice(
            f"amount_micros: {amount_micros} exceeds the invoice balance of {view.balance_micros}",
            field="amount_micros",
        )
    note = CreditNote(
        invoice_id=invoice_id,
        amount_micros=amount_micros,
        currency=invoice.currency,
        reason=reason,
        created_at_us=clock_us() if now_us is None else now_us,
    )
    session.add(note)
    session.flush()
    return CreditNoteView(note.id, invoice_id, amount_micros, note.currency, reason, note.created_at_us)


def get_invoice(session: Session, invoice_id: int, *, tenant: str | None = None) -> InvoiceView:
    """Invoice ``invoice_id``; with ``tenant``, only if it is that tenant's (InvoiceNotFound otherwise: nothing
    of another tenant's invoice is read)."""
    check_invoice_id(invoice_id)
    query = select(Invoice, Tenant.name).join(Tenant, Tenant.id == Invoice.tenant_id).where(Invoice.id == invoice_id)
    if tenant is not None:
        query = query.where(Tenant.name == tenant)
    found = session.execute(query).first()
    if found is None:
        raise InvoiceNotFound(invoice_id)
    return _view(session, *found)


def check_invoice_id(invoice_id: object) -> None:
    """Invoice ids are the database's INTEGER: 1..2^31-1 (a larger one would be refused by PostgreSQL)."""
    if not isinstance(invoice_id, int) or isinstance(invoice_id, bool) or not 1 <= invoice_id <= MAX_INT32:
        raise InvalidArgument(
            f"invoice_id must be an integer in [1, {MAX_INT32}], got {invoice_id!r}", field="invoice_id"
        )


def list_invoices(
    session: Session, *, tenant: str | None = None, period: str | None = None, status: str | None = None
) -> list[InvoiceView]:
    query = select(Invoice, Tenant.name).join(Tenant, Tenant.id == Invoice.tenant_id).order_by(Invoice.id)
    if tenant is not None:
        query = query.where(Invoice.tenant_id == tenant_ids(session, {tenant})[tenant])
    if period is not None:
        query = query.where(Invoice.period == parse_period(period).name)
    if status is not None:
        if status not in {s.value for s in InvoiceStatus}:
            raise InvalidArgument(f"status must be draft, finalized or void, got {status!r}", field="status")
        query = query.where(Invoice.status == status)
    return [_view(session, invoice, name) for invoice, name in session.execute(query)]


def _view(session: Session, invoice: Invoice, tenant: str) -> InvoiceView:
    lines = session.scalars(
        select(InvoiceLine).where(InvoiceLine.invoice_id == invoice.id).order_by(InvoiceLine.position)
    )
    notes = session.scalars(select(CreditNote).where(CreditNote.invoice_id == invoice.id).order_by(CreditNote.id))
    kinds = read_kinds(session, invoice.id)
    return InvoiceView(
        invoice.id,
        tenant,
        invoice.period,
        InvoiceStatus(invoice.status),
        invoice.currency,
        invoice.total_micros,
        invoice.period_start_us,
        invoice.period_end_us,
        invoice.created_at_us,
        invoice.refreshed_at_us,
        invoice.finalized_at_us,
        invoice.voided_at_us,
        tuple(
            InvoiceLineView(
                line.position,
                LineKind(line.kind),
                line.model,
                line.unit,
                line.price_id,
                line.price_micros,
                line.usage_from_us,
                line.usage_to_us,
                line.num_requests,
                line.unit_us,
                line.prompt_tokens,
                line.completion_tokens,
                line.amount_micros,
                line.service_class,
                kinds.get(line.position, ()),
                line.cached_prompt_tokens,
            )
            for line in lines
        ),
        tuple(
            CreditNoteView(n.id, n.invoice_id, n.amount_micros, n.currency, n.reason, n.created_at_us) for n in notes
        ),
    )


def find_open_invoice(session: Session, tenant: str, period: str) -> InvoiceView | None:
    """The tenant's draft or finalized invoice for ``period``, if there is one."""
    tenant_id = tenant_ids(session, {tenant})[tenant]
    invoice = session.scalars(
        select(Invoice).where(
            Invoice.tenant_id == tenant_id, Invoice.period == parse_period(period).name, Invoice.status != "void"
        )
    ).first()
    return None if invoice is None else _view(session, invoice, tenant)
