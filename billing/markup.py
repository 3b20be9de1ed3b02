"""The building blocks of rendered invoices and reports (billing/render.py, billing/render_kinds.py): money as
text, CSV text, HTML tables and pages, and PNG charts. matplotlib is imported inside the chart functions, not at
module level: only HTML output pays for it."""

from __future__ import annotations

import base64
import csv
import html
import io
from collections.abc import Iterable, Sequence

from billing.chargeback import UtilisationPoint


def format_micros(micros: int) -> str:
    """Micro-units as a decimal string with six places: -1234567 → '-1.234567'."""
    sign = "-" if micros < 0 else ""
    whole, fraction = divmod(abs(micros), 1_000_000)
    return f"{sign}{whole}.{fraction:06d}"


def csv_text(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows(rows)
    return buffer.getvalue()


def html_table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    head = "".join(f"<th>{html.escape(str(cell))}</th>" for cell in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_page(title: str, body: Sequence[str]) -> str:
    style = (
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
    )
    return (
        f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n"
    )


def html_img(png: bytes, alt: str) -> str:
    return f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}"></p>'


def _png(figure) -> bytes:  # type: ignore[no-untyped-def]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    return buffer.getvalue()


def bar_chart_png(labels: Sequence[str], amounts_micros: Sequence[int], title: str) -> bytes:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, max(2.5, 0.4 * len(labels) + 1)), layout="constrained")
    axes = figure.add_subplot()
    axes.barh(range(len(labels)), [micros / 1_000_000 for micros in amounts_micros])
    axes.set_yticks(range(len(labels)), labels)
    axes.invert_yaxis()
    axes.set_title(title)
    return _png(figure)


def utilisation_chart_png(timeline: Sequence[UtilisationPoint]) -> bytes:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 3), layout="constrained")
    axes = figure.add_subplot()
    for unit in sorted({point.unit for point in timeline}):
        points = [point for point in timeline if point.unit == unit]
        axes.plot([p.day[5:] for p in points], [p.utilisation_ppm / 10_000 for p in points], marker="o", label=unit)
    axes.set_ylim(0, 100)
    axes.set_ylabel("utilisation %")
    axes.set_title("Device utilisation over time")
    axes.legend()
    return _png(figure)
