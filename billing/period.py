"""Calendar months (UTC) and µs timestamps."""

from __future__ import annotations

import calendar
import datetime as dt
import re
import time
from dataclasses import dataclass

from billing.errors import InvalidPeriod

US_PER_SECOND = 1_000_000
US_PER_MINUTE = 60 * US_PER_SECOND
US_PER_DAY = 86_400 * US_PER_SECOND
# ASCII digits only: \d would also take "２０２６-１２" and "٢٠٢٦-١٢", other spellings of the same month
_PERIOD = re.compile(r"([0-9]{4})-([0-9]{2})", re.ASCII)


def now_us() -> int:
    return time.time_ns() // 1_000


def datetime_to_us(moment: dt.datetime) -> int:
    if moment.tzinfo is None:
        raise ValueError("datetime must be timezone-aware")
    return calendar.timegm(moment.utctimetuple()) * US_PER_SECOND + moment.microsecond


def us_to_datetime(at_us: int) -> dt.datetime:
    return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=at_us)


def day_label(at_us: int) -> str:
    return us_to_datetime(at_us).strftime("%Y-%m-%d")


@dataclass(frozen=True, slots=True)
class Period:
    """A calendar month in UTC: [start_us, end_us)."""

    name: str
    start_us: int
    end_us: int

    @property
    def num_days(self) -> int:
        return (self.end_us - self.start_us) // US_PER_DAY


def parse_period(period: str, *, field: str = "period") -> Period:
    """The month `period` names; its `name` is the one spelling the ledger stores (the database checks it)."""
    match = _PERIOD.fullmatch(period) if isinstance(period, str) else None
    if match is None:
        raise InvalidPeriod(period, field=field)
    year, month = int(match.group(1)), int(match.group(2))
    if not (1970 <= year <= 9998 and 1 <= month <= 12):
        raise InvalidPeriod(period, field=field)
    start = dt.datetime(year, month, 1, tzinfo=dt.UTC)
    end = dt.datetime(year + month // 12, month % 12 + 1, 1, tzinfo=dt.UTC)
    return Period(f"{year:04d}-{month:02d}", datetime_to_us(start), datetime_to_us(end))


def period_of(at_us: int) -> Period:
    return parse_period(us_to_datetime(at_us).strftime("%Y-%m"))
