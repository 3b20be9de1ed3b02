"""The price book: versioned prices per model and unit, and the one rounding rule.

A price is an integer number of micro-units of a currency per unit·second
(per SM·second for ``sm_us``, per core·second for ``core_us``).  A change
adds a new version with a later ``effective_from_us``; no version is edited
(the database refuses UPDATE and DELETE on ``prices``).

Prices per class of service (migration 0005): a version names a class, or
'' (GENERIC_PRICE) for every class without a price of its own.  A call of
class C is priced by C's own version in force at the time, and where C has
none in force yet, by the generic version in force then.

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

from billing.errors import InvalidArgument, InvalidPrice, MissingPrice, PriceExists, UnknownClass
from billing.models import MAX_PRICE_MICROS, Price, ServiceClass
from billing.period import now_us as clock_us
from billing.records import MAX_INT64, Unit, check_class_name, check_text

US_PER_SECOND = 1_000_000
GENERIC_PRICE = ""  # a price version's service_class for every class without a version of its own
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
    service_class: str = GENERIC_PRICE

    @classmethod
    def of(cls, row: Price) -> PriceVersion:
        return cls(
            row.id, row.model, row.unit, row.price_micros, row.currency, row.effective_from_us, row.service_class
        )


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
    service_class: str = GENERIC_PRICE,
) -> PriceVersion:
    """Add a price version in force from ``effective_from_us`` until the next version of the same model, unit
    and class; ``service_class`` '' is the generic price of every class without one of its own, else the name
    of an existing class (UnknownClass otherwise)."""
    _validate(model, unit, price_micros, currency, effective_from_us)
    if service_class != GENERIC_PRICE:
        check_class_name("service_class", service_class, InvalidPrice)
        if session.scalar(select(ServiceClass.id).where(ServiceClass.name == service_class)) is None:
            raise UnknownClass(service_class)
    clash = session.scalar(
        select(Price.id).where(
            Price.model == model,
            Price.unit == unit,
            Price.service_class == service_class,
            Price.effective_from_us == effective_from_us,
        )
    )
    if clash is not None:
        which = f"class {service_class!r}" if service_class else "every class (generic)"
        raise PriceExists(
            f"effective_from_us: a price for {model!r} {unit} of {which} from {effective_from_us} already exists",
            field="effective_from_us",
        )
    row = Price(
        model=model,
        unit=unit,
        service_class=service_class,
        price_micros=price_micros,
        currency=currency,
        effective_from_us=effective_from_us,
        created_at_us=clock_us() if now_us is None else now_us,
    )
    session.add(row)
    session.flush()
    return PriceVersion.of(row)


def price_history(
    session: Session, model: str | None = None, unit: str | None = None, service_class: str | None = None
) -> list[PriceVersion]:
    """Every price version (each with its class, '' for generic), by model, unit, class and start."""
    query = select(Price).order_by(Price.model, Price.unit, Price.service_class, Price.effective_from_us)
    if model is not None:
        query = query.where(Price.model == model)
    if unit is not None:
        query = query.where(Price.unit == unit)
    if service_class is not None:
        query = query.where(Price.service_class == service_class)
    return [PriceVersion.of(row) for row in session.scalars(query)]


class PriceSchedule:
    """Every price version in force before ``end_us``, for lookups while aggregating usage."""

    def __init__(self, versions: list[PriceVersion]) -> None:
        self._versions: dict[tuple[str, str, str], list[PriceVersion]] = {}
        for version in sorted(versions, key=lambda v: v.effective_from_us):
            key = (version.model, version.unit, version.service_class)
            self._versions.setdefault(key, []).append(version)
        self._starts = {key: [v.effective_from_us for v in vs] for key, vs in self._versions.items()}

    @classmethod
    def load(cls, session: Session, end_us: int) -> PriceSchedule:
        rows = session.scalars(select(Price).where(Price.effective_from_us < end_us))
        return cls([PriceVersion.of(row) for row in rows])

    def _latest(self, key: tuple[str, str, str], at_us: int) -> PriceVersion | None:
        index = bisect.bisect_right(self._starts.get(key, []), at_us) - 1
        return self._versions[key][index] if index >= 0 else None

    def version_at(self, model: str, unit: str, at_us: int, service_class: str = GENERIC_PRICE) -> PriceVersion:
        """The version pricing a call of ``service_class`` at ``at_us``: the class's own, else the generic one."""
        version = self._latest((model, unit, service_class), at_us) if service_class != GENERIC_PRICE else None
        version = version or self._latest((model, unit, GENERIC_PRICE), at_us)
        if version is None:
            raise MissingPrice(model, unit, at_us, service_class)
        return version

    def valid_until(self, version: PriceVersion, service_class: str = GENERIC_PRICE) -> int | None:
        """When another version takes over ``version`` for calls of ``service_class`` (None: still in force):
        the class's next own version, or for a generic version also the next generic one."""
        starts = list(self._starts.get((version.model, version.unit, service_class), []) if service_class else [])
        if version.service_class == GENERIC_PRICE:
            starts += self._starts[(version.model, version.unit, GENERIC_PRICE)]
        later = [start for start in starts if start > version.effective_from_us]
        return min(later) if later else None

    def in_force(self, at_us: int) -> list[PriceVersion]:
        """The version of each model, unit and class ('' included) in force at ``at_us``."""
        found = (self._latest(key, at_us) for key in sorted(self._versions))
        return [version for version in found if version is not None]

    def boundaries(self, start_us: int, end_us: int) -> list[int]:
        """``start_us``, every price change strictly inside the range, and ``end_us``, sorted."""
        inside = {
            v.effective_from_us for vs in self._versions.values() for v in vs if start_us < v.effective_from_us < end_us
        }
        return [start_us, *sorted(inside), end_us]


def price_at(session: Session, model: str, unit: str, at_us: int, service_class: str = GENERIC_PRICE) -> PriceVersion:
    """The price version in force for ``model``, ``unit`` and ``service_class`` at ``at_us`` (the class's own,
    else the generic one)."""
    for wanted in dict.fromkeys((service_class, GENERIC_PRICE)):
        row = session.scalars(
            select(Price)
            .where(
                Price.model == model,
                Price.unit == unit,
                Price.service_class == wanted,
                Price.effective_from_us <= at_us,
            )
            .order_by(Price.effective_from_us.desc())
            .limit(1)
        ).first()
        if row is not None:
            return PriceVersion.of(row)
    raise MissingPrice(model, unit, at_us, service_class)
