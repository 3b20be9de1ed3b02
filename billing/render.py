"""Invoices and chargeback reports as JSON, CSV (for finance) and HTML with charts.

Money is written as integer micro-units plus a decimal string computed from
the integer (``format_micros``); charts are the only place numbers become
floats, for drawing. The CSV, HTML and chart building blocks are billing/markup.py; an invoice line's request
kinds are rendered by billing/render_kinds.py.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from enum import StrEnum

from billing.chargeback import ChargebackReport, percent_text
from billing.errors import InvalidArgument
from billing.invoices import InvoiceView
from billing.markup import (
    bar_chart_png,
    csv_text,
    format_micros,
    html_img,
    html_page,
    html_table,
    utilisation_chart_png,
)
from billing.period import us_to_datetime
from billing.render_kinds import KIND_CSV_COLUMN, kind_dicts, kinds_csv_rows, kinds_html

TOKEN_HEADERS = ("Tokens in", "Cached tokens in", "Tokens out")  # the HTML tables' token columns


class Format(StrEnum):
    JSON = "json"
    CSV = "csv"
    HTML = "html"


def parse_format(fmt: str) -> Format:
    if fmt not in {f.value for f in Format}:
        raise InvalidArgument(f"format must be json, csv or html, got {fmt!r}", field="format")
    return Format(fmt)


def _iso(at_us: int | None) -> str | None:
    return None if at_us is None else us_to_datetime(at_us).isoformat().replace("+00:00", "Z")


# --- invoices ----------------------------------------------------------------------------


def invoice_dict(invoice: InvoiceView) -> dict[str, object]:
    return {
        "id": invoice.id,
        "tenant": invoice.tenant,
        "period": invoice.period,
        "status": invoice.status.value,
        "currency": invoice.currency,
        "total_micros": invoice.total_micros,
        "total": format_micros(invoice.total_micros),
        "credited_micros": invoice.credited_micros,
        "balance_micros": invoice.balance_micros,
        "balance": format_micros(invoice.balance_micros),
        "period_start": _iso(invoice.period_start_us),
        "period_end": _iso(invoice.period_end_us),
        "created_at": _iso(invoice.created_at_us),
        "refreshed_at": _iso(invoice.refreshed_at_us),
        "finalized_at": _iso(invoice.finalized_at_us),
        "voided_at": _iso(invoice.voided_at_us),
        "lines": [
            {
                "position": line.position,
                "kind": line.kind.value,
                "description": line.description,
                "model": line.model,
                "unit": line.unit,
                "service_class": line.service_class,
                "price_id": line.price_id,
                "price_micros": line.price_micros,
                "num_requests": line.num_requests,
                "unit_us": line.unit_us,
                "prompt_tokens": line.prompt_tokens,
                "cached_prompt_tokens": line.cached_prompt_tokens,
                "completion_tokens": line.completion_tokens,
                "amount_micros": line.amount_micros,
                "amount": format_micros(line.amount_micros),
                "usage_from": _iso(line.usage_from_us),
                "usage_to": _iso(line.usage_to_us),
                "request_kinds": kind_dicts(line),
            }
            for line in invoice.lines
        ],
        "credit_notes": [
            {
                "id": note.id,
                "amount_micros": note.amount_micros,
                "amount": format_micros(note.amount_micros),
                "reason": note.reason,
                "created_at": _iso(note.created_at_us),
            }
            for note in invoice.credit_notes
        ],
    }


INVOICE_CSV_COLUMNS = (
    "invoice_id",
    "tenant",
    "period",
    "status",
    "currency",
    "position",
    "kind",
    "model",
    "unit",
    "service_class",
    "price_micros",
    "num_requests",
    "unit_us",
    "prompt_tokens",
    "completion_tokens",
    "amount_micros",
    "amount",
)


def invoice_csv(invoice: InvoiceView, *, by_request_kind: bool = False) -> str:
    """One row per line, then the total and any credit notes; ``by_request_kind``: one row per line and request
    kind instead, with the column `request_kind` at the end (billing/render_kinds.py). The columns are those scripts
    already parse, so the prompt tokens the prefix cache served are in JSON and HTML only."""
    head = (invoice.id, invoice.tenant, invoice.period, invoice.status.value, invoice.currency)
    rows: list[Sequence[object]] = []
    for line in invoice.lines:
        prefix = (*head, line.position, line.kind.value, line.model, line.unit, line.service_class, line.price_micros)
        if by_request_kind:
            rows += kinds_csv_rows(prefix, line)
            continue
        usage = (line.num_requests, line.unit_us, line.prompt_tokens, line.completion_tokens, line.amount_micros)
        rows.append((*prefix, *usage, format_micros(line.amount_micros)))
    tail = ("",) if by_request_kind else ()
    rows.append((*head, "", "total", *[""] * 8, invoice.total_micros, format_micros(invoice.total_micros), *tail))
    rows.extend(
        (*head, "", "credit_note", *[""] * 8, -note.amount_micros, format_micros(-note.amount_micros), *tail)
        for note in invoice.credit_notes
    )
    return csv_text((*INVOICE_CSV_COLUMNS, KIND_CSV_COLUMN) if by_request_kind else INVOICE_CSV_COLUMNS, rows)


def invoice_html(invoice: InvoiceView) -> str:
    body = [
        f"<h1>Invoice {invoice.id}: {html.escape(invoice.tenant)}, {invoice.period}</h1>",
        f"<p>Status: <b>{invoice.status.value}</b>. Total: <b>{format_micros(invoice.total_micros)} "
        f"{invoice.currency}</b>. Balance after credit notes: {format_micros(invoice.balance_micros)}.</p>",
        html_table(
            ("#", "Description", "Class", "Requests", "Unit·µs", *TOKEN_HEADERS, f"Amount ({invoice.currency})"),
            [
                (
                    line.position,
                    line.description,
                    line.service_class,
                    line.num_requests,
                    line.unit_us,
                    line.prompt_tokens,
                    line.cached_prompt_tokens,
                    line.completion_tokens,
                    format_micros(line.amount_micros),
                )
                for line in invoice.lines
            ],
        ),
        "<p>Each line sums its usage first, then rounds once, half up, to a micro-unit.</p>",
        kinds_html(invoice),
    ]
    if invoice.credit_notes:
        body.append(
            html_table(
                ("Credit note", "Reason", f"Amount ({invoice.currency})"),
                [(n.id, n.reason, format_micros(-n.amount_micros)) for n in invoice.credit_notes],
            )
        )
    if invoice.lines:
        labels = [f"{line.model} {line.service_class} {line.kind.value}" for line in invoice.lines]
        amounts = [line.amount_micros for line in invoice.lines]
        body.append(html_img(bar_chart_png(labels, amounts, f"Amount by line ({invoice.currency})"), "amount by line"))
    return html_page(f"Invoice {invoice.id}", body)


# --- chargeback --------------------------------------------------------------------------


def chargeback_dict(report: ChargebackReport) -> dict[str, object]:
    return {
        "period": report.period,
        "group_by": list(report.group_by),
        "tenant": report.tenant,
        "generated_at": _iso(report.generated_at_us),
        "rows": [
            {
                **dict(row.group),
                "unit": row.unit,
                "currency": row.currency,
                "num_requests": row.num_requests,
                "num_deadline_met": row.num_deadline_met,
                "num_admitted": row.num_admitted,
                "attainment": row.attainment,
                "unit_us": row.unit_us,
                "prompt_tokens": row.prompt_tokens,
                "cached_prompt_tokens": row.cached_prompt_tokens,
                "completion_tokens": row.completion_tokens,
                "cost_micros": row.cost_micros,
                "cost": format_micros(row.cost_micros),
            }
            for row in report.rows
        ],
        "devices": [
            {
                "device_id": d.device_id,
                "unit": d.unit,
                "num_units": d.num_units,
                "wall_unit_us": d.wall_unit_us,
                "idle_unit_us": d.idle_unit_us,
                "busy_unit_us": d.busy_unit_us,
                "billed_unit_us": d.billed_unit_us,
                "unaccounted_unit_us": d.unaccounted_unit_us,
                "utilisation_ppm": d.utilisation_ppm,
                "utilisation": percent_text(d.busy_unit_us, d.wall_unit_us),
            }
            for d in report.devices
        ],
        "timeline": [
            {
                "day": p.day,
                "unit": p.unit,
                "wall_unit_us": p.wall_unit_us,
                "idle_unit_us": p.idle_unit_us,
                "utilisation_ppm": p.utilisation_ppm,
            }
            for p in report.timeline
        ],
    }


def chargeback_csv(report: ChargebackReport) -> str:
    columns = (
        *report.group_by,
        "unit",
        "currency",
        "num_requests",
        "num_deadline_met",
        "attainment",
        "unit_us",
        "prompt_tokens",
        "cached_prompt_tokens",
        "completion_tokens",
        "cost_micros",
        "cost",
    )
    rows = [
        (
            *(value for _, value in row.group),
            row.unit,
            row.currency,
            row.num_requests,
            row.num_deadline_met,
            row.attainment,
            row.unit_us,
            row.prompt_tokens,
            row.cached_prompt_tokens,
            row.completion_tokens,
            row.cost_micros,
            format_micros(row.cost_micros),
        )
        for row in report.rows
    ]
    return csv_text(columns, rows)


def chargeback_html(report: ChargebackReport) -> str:
    grouping = ", ".join(report.group_by) or "nothing"
    body = [
        f"<h1>Chargeback {report.period}, by {html.escape(grouping)}</h1>",
        html_table(
            (*report.group_by, "Unit", "Requests", "Deadline attainment", "Unit·µs", *TOKEN_HEADERS, "Cost"),
            [
                (
                    *(v for _, v in row.group),
                    row.unit,
                    row.num_requests,
                    row.attainment,
                    row.unit_us,
                    row.prompt_tokens,
                    row.cached_prompt_tokens,
                    row.completion_tokens,
                    f"{format_micros(row.cost_micros)} {row.currency}",
                )
                for row in report.rows
            ],
        ),
    ]
    if report.rows:
        chart = bar_chart_png(
            [row.label for row in report.rows], [row.cost_micros for row in report.rows], f"Cost by {grouping}"
        )
        body.append(html_img(chart, "cost by group"))
    if report.devices:
        body.append("<h2>Device utilisation</h2>")
        body.append(
            html_table(
                ("Device", "Unit", "Units", "Wall unit·µs", "Idle unit·µs", "Billed unit·µs", "Utilisation"),
                [
                    (
                        d.device_id,
                        d.unit,
                        d.num_units,
                        d.wall_unit_us,
                        d.idle_unit_us,
                        d.billed_unit_us,
                        percent_text(d.busy_unit_us, d.wall_unit_us),
                    )
                    for d in report.devices
                ],
            )
        )
    if report.timeline:
        body.append(html_img(utilisation_chart_png(report.timeline), "utilisation over time"))
    return html_page(f"Chargeback {report.period}", body)


def render_invoice(invoice: InvoiceView, fmt: str, *, by_request_kind: bool = False) -> str:
    """``by_request_kind`` splits the CSV's lines by request kind; JSON and HTML always list each line's kinds."""
    match parse_format(fmt):
        case Format.JSON:
            return json.dumps(invoice_dict(invoice), indent=2, ensure_ascii=False) + "\n"
        case Format.CSV:
            return invoice_csv(invoice, by_request_kind=by_request_kind)
        case Format.HTML:
            return invoice_html(invoice)


def render_chargeback(report: ChargebackReport, fmt: str) -> str:
    match parse_format(fmt):
        case Format.JSON:
            return json.dumps(chargeback_dict(report), indent=2, ensure_ascii=False) + "\n"
        case Format.CSV:
            return chargeback_csv(report)
        case Format.HTML:
            return chargeback_html(report)
