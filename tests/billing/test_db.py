"""Engines and the unit of work."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from billing.db import make_engine, session_factory, unit_of_work
from billing.models import Tenant
from tests.billing.conftest import Ledger


def tenants(ledger: Ledger) -> list[str]:
    with ledger.sessions() as session:
        return list(session.scalars(select(Tenant.name).order_by(Tenant.name)))


def test_unit_of_work_commits_on_success_and_rolls_back_on_error(ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        session.add(Tenant(name="kept", created_at_us=1))
    with pytest.raises(ZeroDivisionError), unit_of_work(ledger.sessions) as session:
        session.add(Tenant(name="dropped", created_at_us=1))
        session.flush()
        1 / 0  # noqa: B018
    assert tenants(ledger) == ["kept"]


def test_a_session_without_unit_of_work_commits_nothing(ledger: Ledger) -> None:
    with ledger.sessions() as session:
        session.add(Tenant(name="lost", created_at_us=1))
        session.flush()
        assert session.scalar(select(func.count()).select_from(Tenant)) == 1
    assert tenants(ledger) == []


def test_sqlite_gets_wal_foreign_keys_busy_timeout_and_full_sync(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'nested' / 'dir' / 'ledger.db'}")
    try:
        with engine.connect() as connection:
            pragmas = {
                name: connection.execute(text(f"PRAGMA {name}")).scalar()
                for name in ("journal_mode", "foreign_keys", "busy_timeout", "synchronous")
            }
    finally:
        engine.dispose()
    assert pragmas == {"journal_mode": "wal", "foreign_keys": 1, "busy_timeout": 30_000, "synchronous": 2}
    assert session_factory(engine).kw["expire_on_commit"] is False
