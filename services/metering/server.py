"""Wires the Metering service: runs it alone (`zeroqueue metering`: gRPC server, health, reflection, TLS, a
schema check before serving, a graceful stop), or adds it to another gRPC server in the same process
(`add_metering_to_server`, for `make serve`). The gRPC handlers are in servicer.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from sqlalchemy.orm import Session, sessionmaker
from zeroqueue.metering.v1 import metering_pb2

from billing.db import make_engine, session_factory
from services.auth import Authenticator, LedgerAuthenticator
from services.parsing import add_servicer
from services.standard import SERVICE_NAMES as STANDARD_SERVICES
from services.standard import add_health, enable_reflection

from .schema import check_schema_at_head
from .servicer import MeteringServicer

log = structlog.get_logger(__name__)
METERING_SERVICE = metering_pb2.DESCRIPTOR.services_by_name["Metering"].full_name
LIVENESS = "liveness"
DEFAULT_PORT = 50052
MAX_MESSAGE_BYTES = 16 << 20  # a full RecordUsage batch (10,000 records) fits with room to spare


def add_metering_to_server(
    server: grpc.aio.Server, sessions: sessionmaker[Session], authenticator: Authenticator
) -> MeteringServicer:
    """Registers Metering on `server`; the host adds METERING_SERVICE to its own health and reflection."""
    servicer = MeteringServicer(sessions, authenticator)
    # requests parsed in the handlers: a malformed one is INVALID_ARGUMENT with an ErrorInfo (services/parsing.py)
    add_servicer(server, metering_pb2.DESCRIPTOR.services_by_name["Metering"], servicer)
    return servicer


def server_credentials(tls_cert: str | None, tls_key: str | None) -> grpc.ServerCredentials | None:
    """TLS from PEM files, or None for plaintext; one without the other is a mistake, not plaintext."""
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if tls_cert is None:
        return None
    return grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])


class MeteringApp:
    """The Metering service with health ('', METERING_SERVICE, 'liveness') and reflection, on its own port."""

    def __init__(
        self,
        ledger_url: str,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        authenticator: Authenticator | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.credentials = server_credentials(tls_cert, tls_key)
        self.engine = make_engine(ledger_url)
        self.sessions = session_factory(self.engine)
        self.authenticator = authenticator or LedgerAuthenticator(self.sessions)
        self.health = health_aio.HealthServicer()
        self.server: grpc.aio.Server | None = None

    async def start(self) -> int:
        """Checks the schema is at head (LedgerNotMigrated otherwise), then serves; returns the bound port."""
        revision = await asyncio.to_thread(check_schema_at_head, self.engine)
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        add_metering_to_server(self.server, self.sessions, self.authenticator)
        add_health(self.server, self.health)
        enable_reflection((METERING_SERVICE, *STANDARD_SERVICES), self.server)
        address = f"{self.host}:{self.port}"
        if self.credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, self.credentials)
        await self.server.start()
        for name in ("", METERING_SERVICE, LIVENESS):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "metering_serving",
            address=f"{self.host}:{self.port}",
            tls=self.credentials is not None,
            ledger=self.engine.url.render_as_string(hide_password=True),
            revision=revision,
        )
        return self.port

    async def stop(self, grace_s: float = 5.0) -> None:
        """NOT_SERVING first, so balancers move away, then lets calls in flight finish for up to `grace_s`."""
        for name in ("", METERING_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.server is not None:
            await self.server.stop(grace=grace_s)
        await asyncio.to_thread(self.engine.dispose)
        log.info("metering_stopped")
