"""Tenants and API keys: hashed at rest, authenticated by hash, revocable."""

from __future__ import annotations

import hashlib

import pytest
from sqlalchemy import select, text

from billing.db import unit_of_work
from billing.errors import ApiKeyNotFound, InvalidRecord, PermissionDenied, TenantExists, Unauthenticated
from billing.models import ApiKey, Role
from billing.tenants import authenticate, create_admin_key, create_tenant, create_tenant_key, list_keys, revoke_key
from tests.billing.conftest import Ledger


def test_keys_are_stored_only_as_sha256(ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        issued = create_tenant(session, "acme")
    assert issued.key.startswith("zq_") and len(issued.key) >= 40
    with ledger.sessions() as session:
        row = session.scalars(select(ApiKey)).one()
        dump = " ".join(str(v) for v in session.execute(text("SELECT * FROM api_keys")).one())
    assert row.key_sha256 == hashlib.sha256(issued.key.encode()).hexdigest()
    assert issued.key not in dump and issued.key[10:] not in dump
    assert row.key_prefix == issued.key[:10] == issued.info.key_prefix


def test_authenticate_returns_the_keys_tenant(ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        acme = create_tenant(session, "acme").key
        globex = create_tenant(session, "globex").key
        admin = create_admin_key(session).key
    with ledger.sessions() as session:
        principal = authenticate(session, acme)
        assert (principal.tenant, principal.role) == ("acme", Role.TENANT)
        assert authenticate(session, globex).tenant == "globex"
        root = authenticate(session, admin)
    assert root.is_admin and root.tenant is None
    principal.authorize("acme")
    root.authorize("globex")
    with pytest.raises(PermissionDenied) as caught:
        principal.authorize("globex")
    assert caught.value.field == "tenant"
    with pytest.raises(PermissionDenied):
        principal.require_admin("creating tenants")


@pytest.mark.parametrize("presented", [None, "", "zq_wrong", "zq_" + "A" * 43])
def test_missing_or_wrong_key_is_unauthenticated(ledger: Ledger, presented: str | None) -> None:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
    with ledger.sessions() as session, pytest.raises(Unauthenticated) as caught:
        authenticate(session, presented)
    assert caught.value.field == "authorization"


def test_a_revoked_key_fails_and_the_other_keys_still_work(ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        old = create_tenant(session, "acme")
        new = create_tenant_key(session, "acme")
    with unit_of_work(ledger.sessions) as session:
        info = revoke_key(session, old.info.id, now_us=42)
        again = revoke_key(session, old.info.id, now_us=99)
    assert info.revoked_at_us == again.revoked_at_us == 42
    with ledger.sessions() as session:
        with pytest.raises(Unauthenticated, match="revoked"):
            authenticate(session, old.key)
        assert authenticate(session, new.key).tenant == "acme"
        assert [(k.id, k.revoked_at_us is None) for k in list_keys(session, "acme")] == [
            (old.info.id, False),
            (new.info.id, True),
        ]
        with pytest.raises(ApiKeyNotFound):
            revoke_key(session, 12345)


def test_tenant_names_are_unique_and_validated(ledger: Ledger) -> None:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
    with pytest.raises(TenantExists) as caught, unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
    assert caught.value.field == "name"
    with pytest.raises(InvalidRecord) as invalid, unit_of_work(ledger.sessions) as session:
        create_tenant(session, "Not A Name")
    assert invalid.value.field == "name"
