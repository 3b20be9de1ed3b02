"""Ledger fixtures: every test that takes ``ledger`` runs on SQLite and on PostgreSQL.

Both databases get their schema from the Alembic migrations (the production
DDL, triggers included), once per test run: a migrated SQLite file copied per
test, and a fresh PostgreSQL schema truncated before each test.  With CI=true
an unreachable PostgreSQL fails the tests instead of skipping them.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

import migrations
from billing.db import make_engine, session_factory
from billing.models import MAX_CLASS_BUDGET_MS, PPM, Base

POSTGRES_URL = os.environ.get("ZQ_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
STANDARD_CLASS = text(
    "INSERT INTO service_classes (name, min_budget_ms, max_budget_ms, priority, credit_ppm, created_at_us) "
    f"VALUES ('standard', 1, {MAX_CLASS_BUDGET_MS}, 0, {PPM}, 0)"
)


@dataclass
class Ledger:
    url: str
    engine: Engine
    sessions: sessionmaker[Session]

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name


def require_postgres() -> None:
    """Skip without a server, except under CI where a missing server is a failure."""
    try:
        probe = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
        with probe.connect():
            pass
        probe.dispose()
    except Exception as error:  # noqa: BLE001 - any connection failure means "no server"
        message = f"PostgreSQL at {POSTGRES_URL} is unreachable: {error}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@contextmanager
def fresh_postgres_schema() -> Iterator[str]:
    """A new empty schema; yields a URL whose connections use it, drops it afterwards."""
    require_postgres()
    schema = f"zq_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f"CREATE SCHEMA {schema}"))
    url = make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ledger-template") / "ledger.db"
    migrations.upgrade(f"sqlite+pysqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def postgres_schema_url() -> Iterator[str]:
    with fresh_postgres_schema() as url:
        migrations.upgrade(url)
        yield url


@pytest.fixture(params=BACKENDS)
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    if request.param == "sqlite":
        path = tmp_path / "ledger.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        path.chmod(0o600)  # as the ledger makes its own files (billing/private_files.py)
        url = f"sqlite+pysqlite:///{path}"
    else:
        url = request.getfixturevalue("postgres_schema_url")
        truncate = create_engine(url)
        # every table but ledger_secrets: the page-token secret is made by the migration, like the schema
        tables = ", ".join(table.name for table in Base.metadata.sorted_tables if table.name != "ledger_secrets")
        with truncate.begin() as connection:
            connection.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
            connection.execute(STANDARD_CLASS)  # made by migration 0005, like the schema (TRUNCATE fires no trigger)
        truncate.dispose()
    engine = make_engine(url)
    yield Ledger(url, engine, session_factory(engine))
    engine.dispose()
