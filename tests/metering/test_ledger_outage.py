"""The ledger goes away under load: PostgreSQL connections terminated mid-ingest and new ones refused for a while.

Every record still lands exactly once (callers retry what was answered UNAVAILABLE; a retry of a batch that did
commit is a duplicate, which counts as delivered), and a key nobody has used yet is answered UNAVAILABLE, never
INTERNAL, while the ledger is away. Only this test's own connections are terminated (its own role), so tests
running at the same time on the same database are left alone.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url
from zeroqueue.metering.v1 import metering_pb2 as pb

import migrations
from billing.db import make_engine, session_factory, unit_of_work
from billing.errors import LedgerUnavailable
from billing.models import UsageRow
from billing.period import parse_period
from billing.pricing import add_price
from billing.tenants import create_admin_key, create_tenant
from services.auth import LedgerAuthenticator
from services.metering.servicer import usage_to_pb
from services.status import status_for
from tests.billing.conftest import POSTGRES_URL, require_postgres
from tests.billing.factories import usage
from tests.metering.conftest import bearer
from tests.metering.harness import MeteringThread

START_US = parse_period("2021-03").start_us
NUM_BATCHES, BATCH = 60, 25
U = grpc.StatusCode


@dataclass
class OwnLedger:
    url: str
    role: str
    admin: str
    fresh_keys: list[str]


@pytest.fixture
def own_ledger() -> Iterator[OwnLedger]:
    """A ledger in a new schema reached as a new role: the role's connections are this test's alone."""
    require_postgres()
    name = f"zq_outage_{uuid.uuid4().hex[:10]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f"CREATE ROLE {name} LOGIN"))
        connection.execute(text(f"CREATE SCHEMA {name} AUTHORIZATION {name}"))
    url = (
        make_url(POSTGRES_URL)
        .set(username=name)
        .update_query_dict({"options": f"-csearch_path={name}", "application_name": name})
        .render_as_string(hide_password=False)
    )
    try:
        migrations.upgrade(url)
        engine = make_engine(url)
        with unit_of_work(session_factory(engine)) as session:
            create_tenant(session, "acme")
            add_price(session, "tiny", "core_us", 1_500, "USD", 0)
            admin_key = create_admin_key(session).key
            fresh = [create_tenant(session, f"fresh-{i}").key for i in range(3)]
        engine.dispose()
        yield OwnLedger(url, name, admin_key, fresh)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f"ALTER ROLE {name} LOGIN"))
            connection.execute(text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}'"))
            connection.execute(text(f"DROP SCHEMA {name} CASCADE"))
            connection.execute(text(f"DROP ROLE {name}"))
        admin.dispose()


class Killer:
    """From a separate admin connection: terminates the role's backends, and can refuse its new ones."""

    def __init__(self, role: str) -> None:
        self.role, self.engine = role, create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
        self.kills = 0

    def terminate(self) -> None:
        with self.engine.connect() as connection:
            self.kills += len(
                connection.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND pid <> pg_backend_pid() AND usename = :role"
                    ),
                    {"role": self.role},
                ).all()
            )

    def login(self, allowed: bool) -> None:
        with self.engine.connect() as connection:
            connection.execute(text(f"ALTER ROLE {self.role} {'LOGIN' if allowed else 'NOLOGIN'}"))


def ship(
    stub,
    admin: str,
    batches: queue.Queue,
    codes: Counter,  # type: ignore[no-untyped-def]
    statuses: Counter,
) -> None:
    """A caller: sends each batch until the ledger answers it; only UNAVAILABLE is retried."""
    while True:
        try:
            batch = batches.get_nowait()
        except queue.Empty:
            return
        for attempt in itertools.count():
            try:
                reply = stub.RecordUsage(pb.RecordUsageRequest(records=batch), metadata=bearer(admin), timeout=30)
            except grpc.RpcError as error:
                codes[error.code().name] += 1
                if error.code() != U.UNAVAILABLE or attempt > 500:
                    codes[f"gave up: {error.code().name}: {error.details()}"] += 1
                    break
                time.sleep(0.02)
                continue
            codes["OK"] += 1
            statuses.update(pb.RecordStatus.Name(r.status) for r in reply.records)
            break


@pytest.mark.postgres
def test_terminated_connections_mid_ingest_lose_nothing_and_an_uncached_key_is_unavailable(
    own_ledger: OwnLedger,
) -> None:
    records = [
        usage(f"r-{b}-{i}", finished_at_us=START_US + b * BATCH + i) for b in range(NUM_BATCHES) for i in range(BATCH)
    ]
    batches: queue.Queue = queue.Queue()
    for b in range(NUM_BATCHES):
        batches.put([usage_to_pb(r) for r in records[b * BATCH : (b + 1) * BATCH]])
    codes, statuses, killer = Counter(), Counter(), Killer(own_ledger.role)
    with MeteringThread(own_ledger.url) as server, server.channel() as channel:
        stub = server.stub(channel)
        callers = [
            threading.Thread(target=ship, args=(stub, own_ledger.admin, batches, codes, statuses)) for _ in range(3)
        ]
        for caller in callers:
            caller.start()
        for _ in range(15):  # connections die under the calls in flight
            killer.terminate()
            time.sleep(0.03)
        killer.login(False)  # and for a while no new one is let in
        killer.terminate()
        try:
            for key in own_ledger.fresh_keys[:2]:
                with pytest.raises(grpc.RpcError) as caught:
                    stub.WhoAmI(pb.WhoAmIRequest(), metadata=bearer(key), timeout=30)
                assert caught.value.code() == U.UNAVAILABLE, caught.value.details()
            with pytest.raises(grpc.RpcError) as caught:
                stub.RecordUsage(
                    pb.RecordUsageRequest(records=[usage_to_pb(records[0])]),
                    metadata=bearer(own_ledger.admin),
                    timeout=30,
                )
            assert caught.value.code() == U.UNAVAILABLE
            time.sleep(0.3)
        finally:
            killer.login(True)
        for caller in callers:
            caller.join(120)
        assert (
            stub.WhoAmI(pb.WhoAmIRequest(), metadata=bearer(own_ledger.fresh_keys[0]), timeout=30).tenant == "fresh-0"
        )  # a failed look-up was not remembered
    assert set(codes) <= {"OK", "UNAVAILABLE"}, codes  # never INTERNAL, nothing given up
    assert codes["OK"] == NUM_BATCHES and codes["UNAVAILABLE"] > 0 and killer.kills > 0
    assert set(statuses) <= {"RECORD_STATUS_ACCEPTED", "RECORD_STATUS_DUPLICATE"}, statuses
    engine = make_engine(own_ledger.url)
    try:
        with engine.connect() as connection:
            stored = connection.execute(select(UsageRow.call_id, func.count()).group_by(UsageRow.call_id)).all()
    finally:
        engine.dispose()
    assert sorted(stored) == sorted((r.call_id, 1) for r in records)  # every record, exactly once


def test_a_key_looked_up_in_a_ledger_that_cannot_be_reached_is_unavailable(tmp_path: Path) -> None:
    for url in (
        "postgresql+psycopg://postgres@127.0.0.1:1/test?connect_timeout=2",
        f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'ledger.db'}",
    ):
        engine = create_engine(url)
        authenticator = LedgerAuthenticator(session_factory(engine))
        try:
            with pytest.raises(LedgerUnavailable) as caught:
                asyncio.run(authenticator.authenticate("zq_any"))
            assert status_for(caught.value).code == U.UNAVAILABLE
            assert len(authenticator.cache) == 0  # not cached: the next call asks the ledger again
        finally:
            engine.dispose()
