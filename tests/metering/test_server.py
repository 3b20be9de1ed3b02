"""The Metering process around the servicer: schema check, TLS, hosting in another server, a ledger that is down."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from zeroqueue.metering.v1 import metering_pb2 as pb
from zeroqueue.metering.v1 import metering_pb2_grpc

import migrations
from billing.db import make_engine, session_factory, unit_of_work
from billing.models import Role
from billing.tenants import Principal, create_admin_key
from services.auth import StaticAuthenticator
from services.metering.schema import LedgerNotMigrated
from services.metering.server import add_metering_to_server
from services.metering.servicer import usage_to_pb
from tests.billing.factories import usage
from tests.inference.harness import status_details
from tests.metering.conftest import bearer
from tests.metering.harness import MeteringThread


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "ledger.db"
    shutil.copyfile(sqlite_template, path)
    return f"sqlite+pysqlite:///{path}"


def test_an_unmigrated_ledger_is_refused_with_the_command_that_fixes_it(tmp_path: Path) -> None:
    url = f"sqlite+pysqlite:///{tmp_path}/empty.db"
    with pytest.raises(LedgerNotMigrated, match="no schema.*run `zeroqueue migrate --ledger"):
        MeteringThread(url).start()
    migrations.upgrade(url)
    with MeteringThread(url) as server, server.channel() as channel:
        with pytest.raises(grpc.RpcError) as info:
            server.stub(channel).WhoAmI(pb.WhoAmIRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def self_signed(directory: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls(sqlite_url: str, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    with unit_of_work(session_factory(make_engine(sqlite_url))) as session:
        admin = create_admin_key(session).key
    with MeteringThread(sqlite_url, tls_cert=str(cert), tls_key=str(key)) as server:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(server.address, credentials) as channel:
            who = server.stub(channel).WhoAmI(pb.WhoAmIRequest(), metadata=bearer(admin), timeout=10)
            assert who.role == "admin"
        with server.channel() as plaintext, pytest.raises(grpc.RpcError) as info:
            server.stub(plaintext).WhoAmI(pb.WhoAmIRequest(), metadata=bearer(admin), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_needs_both_files(sqlite_url: str) -> None:
    with pytest.raises(ValueError, match="go together"):
        MeteringThread(sqlite_url, tls_cert="cert.pem")


def test_hosted_in_another_server_and_a_ledger_that_is_down_is_unavailable() -> None:
    """add_metering_to_server as a replica would use it; the ledger URL points at a closed port."""
    engine = make_engine("postgresql+psycopg://postgres@127.0.0.1:1/none", connect_args={"connect_timeout": 2})
    authenticator = StaticAuthenticator({"admin": Principal(None, Role.ADMIN, 1)})

    async def scenario() -> None:
        server = grpc.aio.server()
        add_metering_to_server(server, session_factory(engine), authenticator)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = metering_pb2_grpc.MeteringStub(channel)
                assert (await stub.WhoAmI(pb.WhoAmIRequest(), metadata=bearer("admin"))).role == "admin"
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.RecordUsage(
                        pb.RecordUsageRequest(records=[usage_to_pb(usage("r1"))]), metadata=bearer("admin"), timeout=20
                    )
        finally:
            await server.stop(0)
        error = info.value
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "nothing was stored" in error.details()
        assert status_details(error)["ErrorInfo"].reason == "LEDGER_UNAVAILABLE"

    try:
        asyncio.run(scenario())
    finally:
        engine.dispose()
