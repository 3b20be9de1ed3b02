"""Where a replica's usage goes and how it checks API keys.

Embedded (the default, `make serve`): the replica opens the ledger itself, hosts the Metering service on
its own port, checks keys against the ledger and ships its outbox straight into it. Remote
(`--metering ADDRESS`): keys are checked with the metering service's WhoAmI and usage is shipped with
RecordUsage under an admin key. Either way, records go through the local outbox first.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import structlog
from zeroqueue.metering.v1 import metering_pb2_grpc

from billing.db import default_ledger_url, make_engine, session_factory
from services.auth import Authenticator, LedgerAuthenticator, RemoteAuthenticator
from services.metering.outbox import Outbox
from services.metering.schema import check_schema_at_head
from services.metering.server import METERING_SERVICE, add_metering_to_server
from services.metering.shipper import GrpcSink, LedgerSink, Shipper, Sink

log = structlog.get_logger(__name__)


class MeteringLink:
    """Construct inside a running event loop (the remote mode opens an aio channel)."""

    def __init__(
        self,
        data_dir: Path,
        ledger_url: str | None = None,
        metering_address: str | None = None,
        metering_key: str | None = None,
        metering_ca: str | None = None,
    ) -> None:
        self.outbox = Outbox(data_dir / "outbox.db")
        self.channel: grpc.aio.Channel | None = None
        self.db = None
        self.sink: Sink
        self.authenticator: Authenticator
        if metering_address:
            if not metering_key:
                raise ValueError(
                    "--metering needs an admin key (--metering-key or ZEROQUEUE_METERING_KEY) to ship usage records"
                )
            if metering_ca:
                roots = Path(metering_ca).read_bytes()
                self.channel = grpc.aio.secure_channel(metering_address, grpc.ssl_channel_credentials(roots))
            else:
                self.channel = grpc.aio.insecure_channel(metering_address)
            self.authenticator = RemoteAuthenticator(metering_pb2_grpc.MeteringStub(self.channel))
            self.sink = GrpcSink(self.channel, metering_key)
        else:
            self.db = make_engine(ledger_url or default_ledger_url())
            check_schema_at_head(self.db)
            self.sessions = session_factory(self.db)
            self.authenticator = LedgerAuthenticator(self.sessions)
            self.sink = LedgerSink(self.sessions)
        self.shipper = Shipper(self.outbox, self.sink)
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def hosts_metering(self) -> bool:
        return self.db is not None

    def attach(self, server: grpc.aio.Server) -> tuple[str, ...]:
        """Registers the Metering service on `server` in embedded mode; returns the service names added."""
        if not self.hosts_metering:
            return ()
        add_metering_to_server(server, self.sessions, self.authenticator)
        return (METERING_SERVICE,)

    def start(self) -> None:
        """Starts shipping; what a crash left in the outbox goes first."""
        counts = self.outbox.counts()
        if counts["pending"]:
            log.info("outbox_recovered", **counts)
        self._task = asyncio.create_task(self.shipper.run(self._stop))

    async def stop(self, drain_s: float = 10.0) -> None:
        """Ships what is left (for up to `drain_s`), then closes; undelivered rows wait for the next start."""
        self._stop.set()
        if self._task is not None:
            await self._task
        await asyncio.to_thread(self.outbox.flush)
        if not await self.shipper.drain(drain_s):
            log.warning("outbox_not_drained", **self.outbox.counts())
        self.outbox.close()
        if self.channel is not None:
            await self.channel.close()
        if self.db is not None:
            await asyncio.to_thread(self.db.dispose)
