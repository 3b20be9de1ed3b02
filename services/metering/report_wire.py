"""Invoices and chargeback reports ⇄ metering.v1: what CreateInvoice, FinalizeInvoice, GetInvoice, ListInvoices and
GetChargebackReport send. The servicer (servicer.py) decides who may see them; this only converts."""

from __future__ import annotations

from zeroqueue.metering.v1 import metering_pb2 as pb

from billing import invoices
from billing.chargeback import ChargebackReport
from billing.errors import CurrencyMismatch
from billing.models import InvoiceStatus

_INVOICE_STATUS = {
    InvoiceStatus.DRAFT: pb.INVOICE_STATUS_DRAFT,
    InvoiceStatus.FINALIZED: pb.INVOICE_STATUS_FINALIZED,
    InvoiceStatus.VOID: pb.INVOICE_STATUS_VOID,
}


def invoice_to_pb(view: invoices.InvoiceView) -> pb.Invoice:
    return pb.Invoice(
        id=view.id,
        tenant=view.tenant,
        period=view.period,
        status=_INVOICE_STATUS[view.status],
        currency=view.currency,
        total_micros=view.total_micros,
        balance_micros=view.balance_micros,
        created_at_us=view.created_at_us,
        finalized_at_us=view.finalized_at_us or 0,
        lines=[
            pb.InvoiceLine(
                kind=line.kind.value,
                model=line.model,
                unit=line.unit,
                quantity_unit_us=line.unit_us,
                requests=line.num_requests,
                price_micros=line.price_micros,
                amount_micros=line.amount_micros,
                service_class=line.service_class,
                request_kinds=[
                    pb.RequestKindUsage(
                        request_kind=kind.request_kind.value,
                        requests=kind.num_requests,
                        quantity_unit_us=kind.unit_us,
                        amount_micros=kind.amount_micros,
                    )
                    for kind in line.request_kinds
                ],
            )
            for line in view.lines
        ],
        credit_notes=[
            pb.CreditNote(
                id=note.id, amount_micros=note.amount_micros, reason=note.reason, created_at_us=note.created_at_us
            )
            for note in view.credit_notes
        ],
    )


def chargeback_to_pb(report: ChargebackReport) -> pb.ChargebackReport:
    currencies = sorted({row.currency for row in report.rows})
    if len(currencies) > 1:  # the message has one currency; mixed books cannot be summed
        raise CurrencyMismatch(
            f"period: usage in {report.period} is priced in several currencies ({', '.join(currencies)})",
            field="period",
        )
    return pb.ChargebackReport(
        period=report.period,
        group_by=report.group_by,
        currency=currencies[0] if currencies else "",
        rows=[
            pb.ChargebackRow(
                group=dict(row.group),
                unit_us=row.unit_us,
                unit=row.unit,
                requests=row.num_requests,
                prompt_tokens=row.prompt_tokens,
                cached_prompt_tokens=row.cached_prompt_tokens,
                completion_tokens=row.completion_tokens,
                cost_micros=row.cost_micros,
                deadline_met=row.num_deadline_met,
                admitted=row.num_admitted,
            )
            for row in report.rows
        ],
        devices=[
            pb.DeviceUtilisation(
                device_id=d.device_id,
                unit=d.unit,
                wall_unit_us=d.wall_unit_us,
                idle_unit_us=d.idle_unit_us,
                billed_unit_us=d.billed_unit_us,
            )
            for d in report.devices
        ],
    )
