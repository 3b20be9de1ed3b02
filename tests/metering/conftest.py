"""A Metering service on a real loopback port over each ledger backend (SQLite and PostgreSQL), with keys."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from billing.db import unit_of_work
from billing.pricing import add_price
from billing.tenants import create_admin_key, create_tenant, revoke_key
from tests.billing.conftest import Ledger, ledger, postgres_schema_url, sqlite_template  # noqa: F401 - fixtures
from tests.metering.harness import MeteringThread

__all__ = ["ledger", "postgres_schema_url", "sqlite_template"]


@dataclass(frozen=True)
class Keys:
    admin: str
    acme: str
    globex: str
    revoked: str


@pytest.fixture
def keys(ledger: Ledger) -> Keys:  # noqa: F811 - the imported fixture
    with unit_of_work(ledger.sessions) as session:
        acme, globex = create_tenant(session, "acme"), create_tenant(session, "globex")
        admin, revoked = create_admin_key(session), create_admin_key(session)
        revoke_key(session, revoked.info.id)
        add_price(session, "tiny", "core_us", 1_500, "USD", 0)
    return Keys(admin.key, acme.key, globex.key, revoked.key)


@pytest.fixture
def metering(ledger: Ledger) -> Iterator[MeteringThread]:  # noqa: F811
    with MeteringThread(ledger.url) as server:
        yield server


@pytest.fixture
def stub(metering: MeteringThread):  # type: ignore[no-untyped-def]
    with metering.channel() as channel:
        yield metering.stub(channel)


def bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


def failed(method, request, key: str | None = None) -> grpc.RpcError:  # type: ignore[no-untyped-def]
    """The error of a call that must fail."""
    with pytest.raises(grpc.RpcError) as info:
        method(request, metadata=bearer(key) if key is not None else (), timeout=30)
    return info.value
