"""The SQL of the ledger's CHECK constraints that billing/models.py declares: the rules of billing/records.py and
billing/period.py as the database enforces them, whoever writes.

Migrations freeze their own copy of each expression with the revision that installs it (0003 bounds and periods,
0004 the rules that cross columns, 0007 request kinds, 0008 doors, 0009 cached prompt tokens); tests/billing compares
the two.
"""

from __future__ import annotations

from enum import StrEnum

from billing.records import DEVICE_ID_PREFIXES, MAX_TIME_US, UNIT_OF_KIND, DeviceKind, Door, Outcome, RequestKind, Unit


def one_of(column: str, enum: type[StrEnum]) -> str:
    return f"{column} IN ({', '.join(repr(member.value) for member in enum)})"


# usage_records' enumerated columns, by CHECK name (= column): each holds one value of its enum (0001; request_kind
# 0007, door 0008).
USAGE_ONE_OF = {
    column: one_of(column, enum)
    for column, enum in (
        ("device_kind", DeviceKind),
        ("unit", Unit),
        ("outcome", Outcome),
        ("request_kind", RequestKind),
        ("door", Door),
    )
}


# The bounds of billing/records.py and the ASCII 'YYYY-MM' of billing/period.py (migration 0003: CHECK
# constraints on PostgreSQL, BEFORE triggers on SQLite, the same expressions).
_DIGIT = "('0', '1', '2', '3', '4', '5', '6', '7', '8', '9')"
_MONTH = ", ".join(f"'{month:02d}'" for month in range(1, 13))
PERIOD_FORMAT = (
    "length(period) = 7 AND substr(period, 5, 1) = '-' AND "
    + " AND ".join(f"substr(period, {i}, 1) IN {_DIGIT}" for i in (1, 2, 3, 4))
    + f" AND substr(period, 6, 2) IN ({_MONTH})"
)
USAGE_TIMES = (
    "received_at_us >= 1 AND dispatched_at_us >= received_at_us AND finished_at_us >= dispatched_at_us "
    f"AND finished_at_us < {MAX_TIME_US} AND deadline_at_us >= 1 AND (first_token_at_us IS NULL OR "
    "(first_token_at_us >= dispatched_at_us AND first_token_at_us <= finished_at_us))"
)


# The rules of billing/records.py that cross columns (migration 0004: CHECK constraints on PostgreSQL, BEFORE
# INSERT triggers on SQLite, the same expressions).
def starts_with(column: str, prefixes: tuple[str, ...]) -> str:
    return " OR ".join(f"substr({column}, 1, {len(prefix)}) = '{prefix}'" for prefix in prefixes)


UNIT_OF_DEVICE_KIND = " OR ".join(
    f"(device_kind = '{kind}' AND unit = '{unit}')" for kind, unit in UNIT_OF_KIND.items()
)
USAGE_DEVICE_ID_OF_KIND = " OR ".join(
    f"(device_kind = '{kind}' AND ({starts_with('device_id', prefixes)}))"
    for kind, prefixes in DEVICE_ID_PREFIXES.items()
)
IDLE_DEVICE_ID_OF_UNIT = " OR ".join(
    f"(unit = '{UNIT_OF_KIND[kind]}' AND ({starts_with('device_id', prefixes)}))"
    for kind, prefixes in DEVICE_ID_PREFIXES.items()
)
DEADLINE_MET_ON_TIME = "NOT deadline_met OR finished_at_us <= deadline_at_us"
DEADLINE_EXCEEDED_NOT_MET = f"outcome <> '{Outcome.DEADLINE_EXCEEDED}' OR NOT deadline_met"
OK_DEADLINE_MET_IS_ON_TIME = f"outcome <> '{Outcome.OK}' OR deadline_met = (finished_at_us <= deadline_at_us)"
# The prompt tokens the prefix cache served are some of the prompt's (0009): on usage_records, where the record says
# so, and on invoice_lines and invoice_line_request_kinds, which sum them; CHECK name (= column) cached_prompt_tokens.
CACHED_PROMPT_TOKENS = "cached_prompt_tokens >= 0 AND cached_prompt_tokens <= prompt_tokens"

# usage_records' CHECKs of the expressions above, by CHECK name: its times (0003), the rules that cross columns (0004)
# and the prompt tokens the prefix cache served (0009).
USAGE_RULES = {
    "times_range": USAGE_TIMES,
    "unit_of_device_kind": UNIT_OF_DEVICE_KIND,
    "device_id_of_kind": USAGE_DEVICE_ID_OF_KIND,
    "deadline_met_on_time": DEADLINE_MET_ON_TIME,
    "deadline_exceeded_not_met": DEADLINE_EXCEEDED_NOT_MET,
    "ok_deadline_met_is_on_time": OK_DEADLINE_MET_IS_ON_TIME,
    "cached_prompt_tokens": CACHED_PROMPT_TOKENS,
}
