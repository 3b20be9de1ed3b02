"""Batch statements for ingest: INSERT … ON CONFLICT DO NOTHING RETURNING, and digest look-ups.

SQLite gets a multi-row VALUES statement (SQLAlchemy's insertmanyvalues).
PostgreSQL gets ``INSERT … SELECT FROM unnest(array, …)``: one array
parameter per column instead of one parameter per value, so a 500-row batch
is a short statement the server parses in microseconds rather than an
11,000-placeholder one the driver has to split on every call.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import JSON, Table, Text, bindparam, cast, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.types import TypeEngine


def dialect_insert(session: Session, table: Table):  # type: ignore[no-untyped-def]
    """The dialect's INSERT, which knows ON CONFLICT."""
    name = session.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(f"the ledger supports sqlite and postgresql, not {name}")


def _array_of(column_type: TypeEngine[Any]) -> TypeEngine[Any]:
    return postgresql.ARRAY(Text if isinstance(column_type, JSON) else column_type)


def insert_new(session: Session, table: Table, key: str, rows: Sequence[dict[str, Any]]) -> set[str]:
    """Insert ``rows`` in order, skipping keys already stored; returns the keys inserted now."""
    if session.get_bind().dialect.name != "postgresql":
        statement = dialect_insert(session, table).on_conflict_do_nothing(index_elements=[key])
        return set(session.scalars(statement.returning(table.c[key]), list(rows)))
    names = list(rows[0])
    arrays = [
        bindparam(
            f"col_{name}",
            [json.dumps(row[name]) if isinstance(table.c[name].type, JSON) else row[name] for row in rows],
            type_=_array_of(table.c[name].type),
        )
        for name in names
    ]
    source = func.unnest(*arrays).table_valued(*names).render_derived(name="src")
    values = [cast(source.c[name], JSON) if isinstance(table.c[name].type, JSON) else source.c[name] for name in names]
    statement = (
        postgresql.insert(table)
        .from_select(names, select(*values))
        .on_conflict_do_nothing(index_elements=[key])
        .returning(table.c[key])
    )
    return set(session.scalars(statement))


def stored_digests(session: Session, table: Table, key: str, keys: Sequence[str]) -> dict[str, str]:
    """The stored payload digest of each of ``keys`` that exists."""
    column = table.c[key]
    if session.get_bind().dialect.name == "postgresql":
        match = column == func.any(bindparam("keys", list(keys), type_=postgresql.ARRAY(column.type)))
    else:
        match = column.in_(list(keys))
    return dict(session.execute(select(column, table.c.payload_digest).where(match)).all())
