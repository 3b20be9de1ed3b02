"""An invoice's lines per request kind (billing/invoice_kinds.py) as JSON, CSV rows and an HTML table.

JSON and HTML always show them: JSON as a list under each line's new key `request_kinds` (nothing renamed or
moved), HTML as a table of its own. CSV shows them only when asked (`zeroqueue invoice --by-request-kind`), since
scripts parse it: then each line's row is replaced by one row per kind, with the same columns in the same order
and `request_kind` added at the end, so the usage and credit rows still sum to the total row. Without the option
the CSV is exactly what it was.
"""

from __future__ import annotations

from collections.abc import Sequence

from billing.invoices import InvoiceLineView, InvoiceView
from billing.markup import format_micros, html_table

KIND_CSV_COLUMN = "request_kind"


def kind_dicts(line: InvoiceLineView) -> list[dict[str, object]]:
    return [
        {
            "request_kind": kind.request_kind.value,
            "num_requests": kind.num_requests,
            "unit_us": kind.unit_us,
            "prompt_tokens": kind.prompt_tokens,
            "cached_prompt_tokens": kind.cached_prompt_tokens,
            "completion_tokens": kind.completion_tokens,
            "amount_micros": kind.amount_micros,
            "amount": format_micros(kind.amount_micros),
        }
        for kind in line.request_kinds
    ]


def kinds_csv_rows(prefix: Sequence[object], line: InvoiceLineView) -> list[tuple[object, ...]]:
    """The line's rows per kind: ``prefix`` (the line's columns up to its price), then the kind's usage and
    amount, then the kind. A line without kinds is one row of its own usage, of no kind."""
    usage = [
        (k.num_requests, k.unit_us, k.prompt_tokens, k.completion_tokens, k.amount_micros, k.request_kind.value)
        for k in line.request_kinds
    ] or [(line.num_requests, line.unit_us, line.prompt_tokens, line.completion_tokens, line.amount_micros, "")]
    return [(*prefix, *numbers, amount, format_micros(amount), kind) for *numbers, amount, kind in usage]


def kinds_html(invoice: InvoiceView) -> str:
    rows = [
        (
            line.position,
            line.description,
            kind.request_kind.value,
            kind.num_requests,
            kind.unit_us,
            kind.prompt_tokens,
            kind.cached_prompt_tokens,
            kind.completion_tokens,
            format_micros(kind.amount_micros),
        )
        for line in invoice.lines
        for kind in line.request_kinds
    ]
    if not rows:
        return ""
    header = ("#", "Line", "Request kind", "Requests", "Unit·µs", "Tokens in", "Cached tokens in", "Tokens out")
    return (
        "<h2>Usage by request kind</h2>"
        + html_table((*header, f"Amount ({invoice.currency})"), rows)
        + "<p>A line's amount is split over its request kinds by their unit·µs, at the line's price, rounded to "
        "micro-units so that the kinds add up to the line exactly.</p>"
    )
