"""A Metering service in this process, on a real loopback port, its event loop on a background thread.

For tests and benchmarks that call it through gRPC with plain synchronous stubs.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
from zeroqueue.metering.v1 import metering_pb2_grpc

from services.metering.server import MeteringApp


class MeteringThread:
    def __init__(self, ledger_url: str, **app_options: object) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="metering", daemon=True)
        self.app = MeteringApp(ledger_url, **{"port": 0, **app_options})  # type: ignore[arg-type]
        self.port = 0

    def start(self) -> MeteringThread:
        self.thread.start()
        try:
            self.port = self.run(self.app.start())
        except BaseException:
            self.stop()
            raise
        return self

    def run(self, coro, timeout: float = 60):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace_s: float = 1.0) -> None:
        self.run(self.app.stop(grace_s), timeout=grace_s + 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def __enter__(self) -> MeteringThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return f"{self.app.host}:{self.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stub(self, channel: grpc.Channel | None = None) -> metering_pb2_grpc.MeteringStub:
        return metering_pb2_grpc.MeteringStub(channel or self.channel())
