"""Who is calling: API keys from `authorization: Bearer <key>` metadata, resolved to a billing Principal.

Two authenticators share one small cache keyed by the key's sha256 (never the key itself):
`LedgerAuthenticator` looks keys up in the ledger (the metering service, or an inference replica that
hosts it), `RemoteAuthenticator` asks the metering service's WhoAmI (an inference replica on its own).
A cached principal lives `ttl_s` (a revoked key keeps working at most that long); an unknown or revoked
key is remembered `negative_ttl_s`, so a storm of bad keys costs one lookup per key, not one per call.
Concurrent calls with the same key share one lookup.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Protocol

import grpc
from sqlalchemy.orm import Session, sessionmaker
from zeroqueue.metering.v1 import metering_pb2 as pb

from billing import tenants
from billing.db import ledger_errors, unit_of_work
from billing.errors import Unauthenticated
from billing.models import Role
from billing.tenants import Principal, hash_key
from services.errors import AuthUnavailable

AUTHORIZATION = "authorization"
DEFAULT_TTL_S = 30.0
DEFAULT_NEGATIVE_TTL_S = 5.0
DEFAULT_MAX_ENTRIES = 10_000
WHOAMI_TIMEOUT_S = 5.0


def bearer_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The key of an `authorization: Bearer <key>` entry; None when there is none or it is not Bearer."""
    for name, value in metadata or ():
        if name.lower() != AUTHORIZATION:
            continue
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        scheme, _, key = text.strip().partition(" ")
        return key.strip() or None if scheme.lower() == "bearer" else None
    return None


def missing_key() -> Unauthenticated:
    return Unauthenticated("authorization: missing API key (send 'authorization: Bearer <key>')", field="authorization")


class Authenticator(Protocol):
    async def authenticate(self, key: str | None) -> Principal:
        """The principal behind `key`; raises billing.errors.Unauthenticated if missing, unknown or revoked."""
        ...


class PrincipalCache:
    """Bounded LRU of key digest -> (expiry, Principal | Unauthenticated), with single-flight lookups."""

    def __init__(
        self,
        lookup: Callable[[str], Awaitable[Principal]],
        *,
        ttl_s: float = DEFAULT_TTL_S,
        negative_ttl_s: float = DEFAULT_NEGATIVE_TTL_S,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._lookup, self._clock = lookup, clock
        self.ttl_s, self.negative_ttl_s, self.max_entries = ttl_s, negative_ttl_s, max_entries
        self._entries: OrderedDict[str, tuple[float, Principal | Unauthenticated]] = OrderedDict()
        self._pending: dict[str, asyncio.Future[Principal | Unauthenticated]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str | None) -> Principal:
        if not key:
            raise missing_key()
        digest = hash_key(key)
        found = self._entries.get(digest)
        if found is not None and found[0] > self._clock():
            self._entries.move_to_end(digest)
            return _unwrap(found[1])
        lookup = self._pending.get(digest)
        if lookup is None:
            # Its own task: a caller that gives up does not cancel the lookup the others wait for.
            lookup = asyncio.ensure_future(self._resolve(key, digest))
            self._pending[digest] = lookup
            lookup.add_done_callback(lambda done: self._settle(digest, done))
        return _unwrap(await asyncio.shield(lookup))

    def _settle(self, digest: str, done: asyncio.Future) -> None:
        self._pending.pop(digest, None)
        if not done.cancelled():
            done.exception()  # a failed lookup (ledger down) is not cached; mark it seen if nobody waited

    async def _resolve(self, key: str, digest: str) -> Principal | Unauthenticated:
        try:
            outcome: Principal | Unauthenticated = await self._lookup(key)
            ttl_s = self.ttl_s
        except Unauthenticated as error:
            outcome, ttl_s = error, self.negative_ttl_s
        self._entries[digest] = (self._clock() + ttl_s, outcome)
        self._entries.move_to_end(digest)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return outcome

    def clear(self) -> None:
        self._entries.clear()


def _unwrap(outcome: Principal | Unauthenticated) -> Principal:
    if isinstance(outcome, Unauthenticated):
        raise Unauthenticated(outcome.message, field=outcome.field)
    return outcome


class LedgerAuthenticator:
    """Keys looked up in the ledger (billing.tenants.authenticate), off the event loop."""

    def __init__(self, sessions: sessionmaker[Session], **cache_options: object) -> None:
        self.sessions = sessions
        self.cache = PrincipalCache(self._lookup, **cache_options)  # type: ignore[arg-type]

    async def authenticate(self, key: str | None) -> Principal:
        return await self.cache.get(key)

    async def _lookup(self, key: str) -> Principal:
        return await asyncio.to_thread(self._lookup_sync, key)

    def _lookup_sync(self, key: str) -> Principal:
        # a ledger outage is billing.errors.LedgerUnavailable (UNAVAILABLE), not a raw driver error (INTERNAL);
        # like every failed lookup it is not cached, so the next call asks again
        with ledger_errors(), unit_of_work(self.sessions) as session:  # read-only: the commit ends it
            return tenants.authenticate(session, key)


class RemoteAuthenticator:
    """Keys checked by the metering service's WhoAmI, with the caller's own key."""

    def __init__(self, stub, *, timeout_s: float = WHOAMI_TIMEOUT_S, **cache_options: object) -> None:
        self.stub, self.timeout_s = stub, timeout_s
        self.cache = PrincipalCache(self._lookup, **cache_options)  # type: ignore[arg-type]

    async def authenticate(self, key: str | None) -> Principal:
        return await self.cache.get(key)

    async def _lookup(self, key: str) -> Principal:
        try:
            reply: pb.Principal = await self.stub.WhoAmI(
                pb.WhoAmIRequest(), metadata=((AUTHORIZATION, f"Bearer {key}"),), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise Unauthenticated(
                    error.details() or "authorization: unknown API key", field="authorization"
                ) from error
            raise AuthUnavailable(
                f"the metering service could not check the API key: {error.code().name}: {error.details()}"
            ) from error
        # WhoAmI does not reveal key ids; 0 marks a principal resolved remotely.
        return Principal(reply.tenant or None, Role(reply.role), 0)


class StaticAuthenticator:
    """A fixed key -> Principal mapping, for tests."""

    def __init__(self, principals: Mapping[str, Principal]) -> None:
        self.principals = dict(principals)

    async def authenticate(self, key: str | None) -> Principal:
        if not key:
            raise missing_key()
        found = self.principals.get(key)
        if found is None:
            raise Unauthenticated("authorization: unknown API key", field="authorization")
        return found
