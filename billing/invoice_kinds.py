"""Invoice lines split by request kind (issue 31): what each line bills, per kind of call.

A line is still priced once over all its usage (billing/invoices.py), so the invoice's lines and total are what
they were before kinds. Each line then lists its kinds (table ``invoice_line_request_kinds``, frozen with the
invoice): requests, unit·µs and tokens (the prompt tokens the prefix cache served too) summed per kind, which add up
to the line exactly, and the line's amount split over its kinds in proportion to their unit·µs, in integers, by
largest remainder (ties to the earlier kind in :class:`RequestKind` order), so the kinds' amounts add up to the
line's amount exactly. Every kind of a line is at the line's price: device time stays the measured truth, the kind
only labels it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.aggregate import SUMMED, UsageAggregate
from billing.models import InvoiceLineRequestKind, LineKind
from billing.records import RequestKind

_ORDER = {kind: index for index, kind in enumerate(RequestKind)}
_SUMMED = (
    "num_requests",
    "unit_us",
    "prompt_tokens",
    "completion_tokens",
    "num_missed",
    "missed_unit_us",
    "missed_prompt_tokens",
    "missed_completion_tokens",
    "cached_prompt_tokens",
    "missed_cached_prompt_tokens",
)


@dataclass(frozen=True, slots=True)
class RequestKindUsage:
    """One invoice line's usage of one request kind."""

    request_kind: RequestKind
    num_requests: int
    unit_us: int
    prompt_tokens: int
    completion_tokens: int
    amount_micros: int  # the kind's share of the line's amount; negative on a credit line
    cached_prompt_tokens: int = 0  # of prompt_tokens, those the prefix cache served (issue 33)


@dataclass(frozen=True, slots=True)
class KindedAggregate:
    """The usage of one future invoice line (model, unit, class, price version), summed over its kinds, and the
    same usage per kind (``key`` = (request_kind,)), in kind order."""

    total: UsageAggregate
    kinds: tuple[UsageAggregate, ...]


def allocate(amount: int, weights: Sequence[int]) -> list[int]:
    """Integer parts of ``amount`` (of either sign) proportional to ``weights`` (non-negative, at least one
    positive) that add up to ``amount`` exactly: largest remainder, ties to the earlier weight."""
    weight_sum = sum(weights)
    if weight_sum <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    sign, whole = (-1, -amount) if amount < 0 else (1, amount)
    parts = [whole * w // weight_sum for w in weights]
    remainders = [whole * w % weight_sum for w in weights]
    for i in sorted(range(len(weights)), key=lambda i: (-remainders[i], i))[: whole - sum(parts)]:
        parts[i] += 1
    return [sign * part for part in parts]


def by_line(aggregates: Iterable[UsageAggregate]) -> list[KindedAggregate]:
    """Aggregates grouped by ``request_kind`` (aggregate_usage's ``group_by=("request_kind",)``), joined per
    model, unit, class and price version: the sums are the integers an ungrouped aggregate would hold."""
    parts: dict[tuple[object, ...], list[UsageAggregate]] = {}
    for agg in aggregates:
        parts.setdefault((agg.model, agg.unit, agg.service_class, agg.price.id), []).append(agg)
    lines = []
    for group in parts.values():
        group.sort(key=lambda agg: _ORDER[RequestKind(agg.key[0])])
        sums = {name: sum(getattr(agg, name) for agg in group) for name in _SUMMED}
        lines.append(KindedAggregate(replace(group[0], key=(), **sums), tuple(group)))
    return lines


def kind_rows(position: int, kind: LineKind, amount_micros: int, kinds: Sequence[UsageAggregate]) -> list[dict]:
    """The rows of ``invoice_line_request_kinds`` for the line at ``position``: its usage or, for an SLA credit
    line, its missed usage, per kind that has any; the line's amount split by their unit·µs."""
    missed = kind is LineKind.SLA_CREDIT
    usage = [
        {
            "request_kind": agg.key[0],
            "num_requests": agg.num_missed if missed else agg.num_requests,
            **{name: getattr(agg, f"missed_{name}" if missed else name) for name in SUMMED},
        }
        for agg in kinds
        if agg.num_missed or not missed
    ]
    weights = [row["unit_us"] for row in usage]
    if not any(weights):  # no device time at all: the amount is 0, split by requests
        weights = [row["num_requests"] for row in usage]
    return [
        dict(row, amount_micros=amount, position=position)
        for row, amount in zip(usage, allocate(amount_micros, weights), strict=True)
    ]


def read_kinds(session: Session, invoice_id: int) -> dict[int, tuple[RequestKindUsage, ...]]:
    """Each line's kinds, by the line's position, in kind order."""
    rows = session.scalars(select(InvoiceLineRequestKind).where(InvoiceLineRequestKind.invoice_id == invoice_id))
    found: dict[int, list[RequestKindUsage]] = {}
    for row in rows:
        found.setdefault(row.position, []).append(
            RequestKindUsage(
                RequestKind(row.request_kind),
                row.num_requests,
                row.unit_us,
                row.prompt_tokens,
                row.completion_tokens,
                row.amount_micros,
                row.cached_prompt_tokens,
            )
        )
    return {position: tuple(sorted(kinds, key=lambda k: _ORDER[k.request_kind])) for position, kinds in found.items()}
