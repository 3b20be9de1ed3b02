"""The price book: versioned prices per model and unit, and the one rounding rule.

A price is an integer number of micro-units of a currency per unit·second
(per SM·second for ``sm_us``, per core·second for ``core_us``).  A change
adds a new version with a later ``effective_from_us``; no version is edited
(the database refuses UPDATE and DELETE on ``prices``).

Rounding rule: the cost of an invoice line is

    cost_micros = round_half_up(total_unit_us × price_micros / 1_000_000)

computed with integers only, ONCE per line, after the line's usage has been
aggregated.  Individual requests are never rounded.  Python integers cannot
overflow; what is stored (a line's amount, an invoice's total) is checked
against the signed 64-bit columns first (billing.aggregate.check_int64), and
a price is at most MAX_PRICE_MICROS, so a line's amount is at most 1,000 ×
its unit·µs.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.errors import InvalidArgument, InvalidPrice, MissingPrice, PriceExists
from billing.models import MAX_PRICE_MICROS, Price
from billing.period import now_us as clock_us
from billing.records import MAX_INT64, Unit, check_text

US_PER_SECOND = 1_000_000
_CURRENCY = re.compile(r"[A-Z]{3}")


def cost_micros(unit_us: int, price_micros: int) -> int:
    """``unit_us × price_micros / 1e6`` rounded half up, in integers (both arguments ≥ 0)."""
    if unit_us < 0 or price_micros < 0:
        raise ValueError("cost_micros takes non-negative usage and price")
    return (unit_us * price_micros + US_PER_SECOND // 2) // US_PER_SECOND


@dataclass(frozen=True, slots=True)
class PriceVersion:
    id: int
    model: str
    unit: str
    price_micros: int
    currency: str
    effective_from_us: int

    @classmethod
    def of(cls, row: Price) -> PriceVersion:
        return cls(row.id, row.model, row.unit, row.price_micros, row.currency, row.effective_from_us)


def _validate(model: str, unit: str, price_micros: int, currency: str, effective_from_us: int) -> None:
    try:
        check_text("model", model)
    except InvalidArgument as error:
        raise InvalidPrice(error.message, field="model") from None
    if unit not in {member.value for member in Unit}:
        raise InvalidPrice(f"unit must be sm_us or core_us, got {unit!r}", field="unit")
    for name, value, maximum in (
        ("price_micros", price_micros, MAX_PRICE_MICROS),
        ("effective_from_us", effective_from_us, MAX_INT64),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= maximum:
            raise InvalidPrice(f"{name} must be an integer in [0, {maximum}], got {value!r}", field=name)
    if not isinstance(currency, str) or not _CURRENCY.fullmatch(currency):
        raise InvalidPrice(f"currency must be an ISO 4217 code like USD, got {currency!r}", field="currency")


def add_price(
    session: Session,
    model: str,
    unit: str,
    price_micros: int,
    currency: str,
    effective_from_us: int,
    *,
    now_us: int | None = None,
) -> PriceVersion:
    """Add a price version in force from ``effective_from_us`` until the next version."""
    _validate(model, unit, price_micros, currency, effective_from_us)
    clash = session.scalar(
        select(Price.id).where(Price.model == model, Price.unit == unit, Price.effective_from_us == effective_from_us)
    )
    if clash is not None:
        raise PriceExists(
            f"effective_from_us: a price for {model!r} {unit} from {effective_from_us} already exists",
            field="effective_from_us",
        )
    row = Price(
        model=model,
        unit=unit,
        price_micros=price_micros,
        currency=currency,
        effective_from_us=effective_from_us,
        created_at_us=clock_us() if now_us is None else now_us,
    )
    session.add(row)
    session.flush()
    return PriceVersion.of(row)


def price_history(session: Session, model: str | None = None, unit: str | None = None) -> list[PriceVersion]:
    query = select(Price).order_by(Price.model, Price.unit, Price.effective_from_us)
    if model is not None:
        query = query.where(Price.model == model)
    if unit is not None:
        query = query.where(Price.unit == unit)
    return [PriceVersion.of(row) for row in session.scalars(query)]


class PriceSchedule:
    """Every price version in force before ``end_us``, for lookups while aggregating usage."""

    def __init__(self, versions: list[PriceVersion]) -> None:
        self._versions: dict[tuple[str, str], list[PriceVersion]] = {}
        for version in sorted(versions, key=lambda v: v.effective_from_us):
            self._versions.setdefault((version.model, version.unit), []).append(version)
        self._starts = {key: [v.effective_from_us for v in vs] for key, vs in self._versions.items()}

    @classmethod
    def load(cls, session: Session, end_us: int) -> PriceSchedule:
        rows = session.scalars(select(Price).where(Price.effective_from_us < end_us))
        return cls([PriceVersion.of(row) for row in rows])

    def version_at(self, model: str, unit: str, at_us: int) -> PriceVersion:
        starts = self._starts.get((model, unit), [])
        index = bisect.bisect_right(starts, at_us) - 1
        if index < 0:
            raise MissingPrice(model, unit, at_us)
        return self._versions[(model, unit)][index]

    def valid_until(self, version: PriceVersion) -> int | None:
        """When the next version of the same model and unit takes over (None: still in force)."""
        versions = self._versions[(version.model, version.unit)]
        index = versions.index(version)
        return versions[index + 1].effective_from_us if index + 1 < len(versions) else None

    def boundaries(self, start_us: int, end_us: int) -> list[int]:
        """``start_us``, every price change strictly inside the range, and ``end_us``, sorted."""
        inside = {
            v.effective_from_us for vs in self._versions.values() for v in vs if start_us < v.effective_from_us < end_us
        }
        return [start_us, *sorted(inside), end_us]


def price_at(session: Session, model: str, unit: str, at_us: int) -> PriceVersion:
    """The price version in force for ``model`` and ``unit`` at ``at_us``."""
    row = session.scalars(
        select(Price)
        .where(Price.model == model, Price.unit == unit, Price.effective_from_us <= at_us)
        .order_by(Price.effective_from_us.desc())
        .limit(1)
    ).first()
    if row is None:
        raise MissingPrice(model, unit, at_us)
    return PriceVersion.of(row)
