"""API keys from metadata, the principal cache, and the ledger, remote and static authenticators."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from zeroqueue.metering.v1 import metering_pb2_grpc

from billing.db import unit_of_work
from billing.errors import Unauthenticated
from billing.models import Role
from billing.tenants import Principal, list_keys, revoke_key
from services.auth import LedgerAuthenticator, PrincipalCache, RemoteAuthenticator, StaticAuthenticator, bearer_key
from services.errors import AuthUnavailable
from tests.billing.conftest import Ledger
from tests.metering.conftest import Keys

ACME = Principal("acme", Role.TENANT, 1)


@pytest.mark.parametrize(
    "metadata, key",
    [
        ((("authorization", "Bearer zq_abc"),), "zq_abc"),
        ((("x-other", "1"), ("Authorization", "bearer  zq_abc ")), "zq_abc"),
        ((("authorization", b"Bearer zq_abc"),), "zq_abc"),
        ((("authorization", "Basic zq_abc"),), None),
        ((("authorization", "Bearer"),), None),
        ((("authorization", "Bearer "),), None),
        ((), None),
        (None, None),
    ],
)
def test_bearer_key(metadata, key) -> None:  # type: ignore[no-untyped-def]
    assert bearer_key(metadata) == key


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingLookup:
    """Knows one key; counts how often it is asked, optionally slowly or failing."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls: list[str] = []
        self.delay_s, self.fail = delay_s, False

    async def __call__(self, key: str) -> Principal:
        self.calls.append(key)
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("ledger down")
        if key != "good":
            raise Unauthenticated("authorization: unknown API key", field="authorization")
        return ACME


def make_cache(**options):  # type: ignore[no-untyped-def]
    lookup, clock = CountingLookup(options.pop("delay_s", 0.0)), FakeClock()
    return PrincipalCache(lookup, clock=clock, **options), lookup, clock


def test_a_known_key_is_looked_up_once_per_ttl() -> None:
    async def scenario() -> None:
        cache, lookup, clock = make_cache(ttl_s=30, negative_ttl_s=5)
        assert [await cache.get("good") for _ in range(100)] == [ACME] * 100
        clock.now += 29
        await cache.get("good")
        assert len(lookup.calls) == 1
        clock.now += 2
        await cache.get("good")
        assert len(lookup.calls) == 2

    asyncio.run(scenario())


def test_a_storm_of_one_bad_key_costs_one_lookup_per_negative_ttl() -> None:
    async def scenario() -> None:
        cache, lookup, clock = make_cache(ttl_s=30, negative_ttl_s=5)
        for _ in range(1000):
            with pytest.raises(Unauthenticated, match="unknown API key"):
                await cache.get("bad")
        assert lookup.calls == ["bad"]
        clock.now += 6
        with pytest.raises(Unauthenticated):
            await cache.get("bad")
        assert lookup.calls == ["bad", "bad"]

    asyncio.run(scenario())


def test_concurrent_calls_with_one_key_share_one_lookup() -> None:
    async def scenario() -> None:
        cache, lookup, _ = make_cache(delay_s=0.05)
        results = await asyncio.gather(
            *(cache.get("good") for _ in range(50)), *(cache.get("bad") for _ in range(50)), return_exceptions=True
        )
        assert results[:50] == [ACME] * 50 and all(isinstance(r, Unauthenticated) for r in results[50:])
        assert sorted(lookup.calls) == ["bad", "good"]

    asyncio.run(scenario())


def test_the_cache_is_bounded_and_evicts_the_least_recently_used() -> None:
    async def scenario() -> None:
        cache, lookup, _ = make_cache(max_entries=3)
        for key in ("k1", "k2", "k3", "k1", "k4"):  # k1 used again, so k2 is the oldest when k4 arrives
            with pytest.raises(Unauthenticated):
                await cache.get(key)
        assert len(cache) == 3 and lookup.calls == ["k1", "k2", "k3", "k4"]
        for key in ("k1", "k3", "k4", "k2"):
            with pytest.raises(Unauthenticated):
                await cache.get(key)
        assert lookup.calls == ["k1", "k2", "k3", "k4", "k2"]

    asyncio.run(scenario())


def test_a_failed_lookup_is_not_cached_and_a_missing_key_is_not_looked_up() -> None:
    async def scenario() -> None:
        cache, lookup, _ = make_cache()
        lookup.fail = True
        with pytest.raises(ConnectionError):
            await cache.get("good")
        lookup.fail = False
        assert await cache.get("good") == ACME
        assert lookup.calls == ["good", "good"]
        for missing in (None, ""):
            with pytest.raises(Unauthenticated, match="missing API key"):
                await cache.get(missing)
        assert len(lookup.calls) == 2

    asyncio.run(scenario())


def test_ledger_authenticator_honours_a_revocation_after_the_ttl(ledger: Ledger, keys: Keys) -> None:
    clock = FakeClock()
    authenticator = LedgerAuthenticator(ledger.sessions, ttl_s=30, clock=clock)

    async def scenario() -> None:
        assert await authenticator.authenticate(keys.acme) == Principal("acme", Role.TENANT, acme_key_id)
        assert (await authenticator.authenticate(keys.admin)).is_admin
        for key in (keys.revoked, "zq_unknown", None):
            with pytest.raises(Unauthenticated):
                await authenticator.authenticate(key)
        with unit_of_work(ledger.sessions) as session:
            revoke_key(session, acme_key_id)
        assert (await authenticator.authenticate(keys.acme)).tenant == "acme"  # cached: at most ttl_s stale
        clock.now += 31
        with pytest.raises(Unauthenticated, match="revoked"):
            await authenticator.authenticate(keys.acme)

    with ledger.sessions() as session:
        acme_key_id = list_keys(session, "acme")[0].id
    asyncio.run(scenario())


def test_remote_authenticator_asks_who_am_i(metering, keys: Keys) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> None:
        async with grpc.aio.insecure_channel(metering.address) as channel:
            remote = RemoteAuthenticator(metering_pb2_grpc.MeteringStub(channel))
            assert await remote.authenticate(keys.acme) == Principal("acme", Role.TENANT, 0)
            assert await remote.authenticate(keys.admin) == Principal(None, Role.ADMIN, 0)
            with pytest.raises(Unauthenticated, match="revoked"):
                await remote.authenticate(keys.revoked)
            with pytest.raises(Unauthenticated, match="unknown"):
                await remote.authenticate("zq_unknown")
            with pytest.raises(Unauthenticated, match="missing"):
                await remote.authenticate(None)

    asyncio.run(scenario())


def test_remote_authenticator_without_a_metering_service_is_unavailable_not_unauthenticated() -> None:
    with socket.socket() as probe:  # a port that nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            remote = RemoteAuthenticator(metering_pb2_grpc.MeteringStub(channel), timeout_s=2)
            with pytest.raises(AuthUnavailable, match="UNAVAILABLE"):
                await remote.authenticate("zq_any")

    asyncio.run(scenario())


def test_static_authenticator() -> None:
    static = StaticAuthenticator({"k": ACME})
    assert asyncio.run(static.authenticate("k")) == ACME
    for key in ("other", None):
        with pytest.raises(Unauthenticated):
            asyncio.run(static.authenticate(key))
