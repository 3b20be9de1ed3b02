"""Tenants, API keys and authentication.

A key is ``zq_`` + ``secrets.token_urlsafe(32)`` and is shown once.  Only its
sha256 is stored, so authentication hashes the presented key and looks the
hash up: no secret is ever compared character by character (the final
``hmac.compare_digest`` is belt and braces), and a leaked table holds no key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.errors import ApiKeyNotFound, PermissionDenied, TenantExists, Unauthenticated, UnknownTenant
from billing.models import ApiKey, Role, Tenant
from billing.period import now_us as clock_us
from billing.records import check_tenant_name

KEY_PREFIX = "zq_"
DISPLAY_PREFIX_CHARS = 10


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a tenant's key (``tenant`` set) or an admin key (``tenant`` None)."""

    tenant: str | None
    role: Role
    key_id: int

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    def authorize(self, tenant: str) -> None:
        """Allow access to ``tenant``'s usage and invoices: its own keys and admin keys only."""
        if not self.is_admin and self.tenant != tenant:
            raise PermissionDenied(  # the name asked for is not repeated: a refusal says nothing of others
                f"tenant: this key belongs to tenant {self.tenant!r} and reaches only its own data", field="tenant"
            )

    def require_admin(self, action: str) -> None:
        if not self.is_admin:
            raise PermissionDenied(f"{action} needs an admin key", field="authorization")


@dataclass(frozen=True, slots=True)
class ApiKeyInfo:
    id: int
    tenant: str | None
    role: Role
    key_prefix: str
    created_at_us: int
    revoked_at_us: int | None


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A freshly created key: ``key`` is the only copy of the plaintext."""

    key: str
    info: ApiKeyInfo


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_tenant(session: Session, name: str, *, now_us: int | None = None) -> IssuedKey:
    """Create tenant ``name`` and its first key; the plaintext key is returned once."""
    check_tenant_name("name", name)
    if session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise TenantExists(name)
    now_us = clock_us() if now_us is None else now_us
    tenant = Tenant(name=name, created_at_us=now_us)
    session.add(tenant)
    session.flush()
    return _issue(session, tenant, Role.TENANT, now_us)


def create_tenant_key(session: Session, tenant: str, *, now_us: int | None = None) -> IssuedKey:
    """Another key for an existing tenant (for rotation)."""
    row = session.scalar(select(Tenant).where(Tenant.name == tenant))
    if row is None:
        raise UnknownTenant(tenant)
    return _issue(session, row, Role.TENANT, clock_us() if now_us is None else now_us)


def create_admin_key(session: Session, *, now_us: int | None = None) -> IssuedKey:
    return _issue(session, None, Role.ADMIN, clock_us() if now_us is None else now_us)


def _issue(session: Session, tenant: Tenant | None, role: Role, now_us: int) -> IssuedKey:
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(
        tenant_id=tenant.id if tenant else None,
        role=role.value,
        key_sha256=hash_key(key),
        key_prefix=key[:DISPLAY_PREFIX_CHARS],
        created_at_us=now_us,
    )
    session.add(row)
    session.flush()
    return IssuedKey(key, _info(row, tenant.name if tenant else None))


def _info(row: ApiKey, tenant: str | None) -> ApiKeyInfo:
    return ApiKeyInfo(row.id, tenant, Role(row.role), row.key_prefix, row.created_at_us, row.revoked_at_us)


def authenticate(session: Session, key: str | None) -> Principal:
    """The principal behind ``key``; :class:`Unauthenticated` if it is missing, unknown or revoked."""
    if not key:
        raise Unauthenticated(
            "authorization: missing API key (send 'authorization: Bearer <key>')", field="authorization"
        )
    digest = hash_key(key)
    found = session.execute(
        select(ApiKey, Tenant.name).outerjoin(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.key_sha256 == digest)
    ).first()
    if found is None or not hmac.compare_digest(found[0].key_sha256, digest):
        raise Unauthenticated("authorization: unknown API key", field="authorization")
    row, tenant = found
    if row.revoked_at_us is not None:
        raise Unauthenticated("authorization: this API key was revoked", field="authorization")
    return Principal(tenant, Role(row.role), row.id)


def revoke_key(session: Session, key_id: int, *, now_us: int | None = None) -> ApiKeyInfo:
    """Revoke a key by id (see :func:`list_keys`); revoking twice keeps the first time."""
    found = session.execute(
        select(ApiKey, Tenant.name).outerjoin(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.id == key_id)
    ).first()
    if found is None:
        raise ApiKeyNotFound(key_id)
    row, tenant = found
    if row.revoked_at_us is None:
        row.revoked_at_us = clock_us() if now_us is None else now_us
        session.flush()
    return _info(row, tenant)


def list_keys(session: Session, tenant: str | None = None) -> list[ApiKeyInfo]:
    query = select(ApiKey, Tenant.name).outerjoin(Tenant, Tenant.id == ApiKey.tenant_id).order_by(ApiKey.id)
    if tenant is not None:
        query = query.where(Tenant.name == tenant)
    return [_info(row, name) for row, name in session.execute(query)]


def list_tenants(session: Session) -> list[str]:
    return list(session.scalars(select(Tenant.name).order_by(Tenant.name)))
