"""A replica in this process, on a real loopback port, its event loop on a background thread.

For tests and benchmarks that drive a server and look inside it at the same time.
"""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from zeroqueue.inference.v1 import inference_pb2_grpc

from billing import commands
from services.client.auth import authorized_channel
from services.inference.device.executor import Executor
from services.inference.replica import Replica
from services.inference.serve_config import ServeConfig


class ServerThread:
    """Without a data_dir it gets a fresh temporary one; without a ledger or metering service, a fresh SQLite
    ledger there with one tenant, whose key `stub()` sends."""

    def __init__(
        self,
        config: ServeConfig,
        step_floor_s: float = 0.0,
        tenant: str = "acme",
        make_executor: Callable[..., Executor] | None = None,
    ) -> None:
        self.step_floor_s = step_floor_s
        self.make_executor = make_executor  # module-level, to cross into the engine process
        self.key = ""
        if config.data_dir is None:
            config = replace(config, data_dir=tempfile.mkdtemp(prefix="zeroqueue-"))
        if not config.ledger_url and not config.metering_address:
            url = f"sqlite:///{Path(config.data_dir) / 'ledger.db'}"
            commands.migrate(url)
            self.key = commands.create_tenant(url, tenant)
            config = replace(config, ledger_url=url)
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.replica: Replica | None = None
        self.port = 0

    def start(self, wait_ready: bool = True) -> ServerThread:
        self.thread.start()
        self.replica = self.run(self._make_replica())
        self.started: Future = asyncio.run_coroutine_threadsafe(self.replica.start(), self.loop)
        if wait_ready:
            self.port = self.started.result(timeout=300)
        else:
            while not self.replica.port:
                time.sleep(0.01)
            self.port = self.replica.port
        return self

    async def _make_replica(self) -> Replica:
        if self.make_executor is not None:
            return Replica(self.config, make_executor=self.make_executor)
        floor = self.step_floor_s
        # a partial of a module-level class: it can cross into the engine process
        return Replica(self.config, make_executor=functools.partial(SlowExecutor, floor_s=floor) if floor else Executor)

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace_s: float = 10.0) -> None:
        if not self.thread.is_alive():  # stopped already
            return
        if self.replica is not None:
            stopping = asyncio.run_coroutine_threadsafe(self.replica.stop(grace_s), self.loop)
            try:
                stopping.result(grace_s + 30)
            except TimeoutError:
                self._dump_stuck()
                raise
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _dump_stuck(self) -> None:
        """A stop that hangs says where: every thread's stack and the loop's pending tasks, on stderr."""
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        for task in asyncio.all_tasks(self.loop):
            task.print_stack(limit=8, file=sys.stderr)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self, key: str | None = None, **options) -> grpc.Channel:
        return authorized_channel(self.address, self.key if key is None else key, list(options.items()))

    def stub(self, key: str | None = None, **options) -> inference_pb2_grpc.InferenceStub:
        return inference_pb2_grpc.InferenceStub(self.channel(key, **options))


class SlowExecutor(Executor):
    """A fake slow device: every step takes at least `floor_s`, so a test's timing is dominated by it."""

    def __init__(self, checkpoint, config, floor_s: float = 0.0) -> None:
        super().__init__(checkpoint, config)
        self.floor_s = floor_s

    def run(self, step):
        t0 = time.monotonic()
        result = super().run(step)
        time.sleep(max(self.floor_s - (time.monotonic() - t0), 0))
        return result


def status_details(error: grpc.RpcError) -> dict:
    """The google.rpc details of a failed call, by type name."""
    status: status_pb2.Status = rpc_status.from_call(error)
    found = {}
    for detail in status.details if status else ():
        for cls in (error_details_pb2.BadRequest, error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo):
            if detail.Is(cls.DESCRIPTOR):
                message = cls()
                detail.Unpack(message)
                found[cls.DESCRIPTOR.name] = message
    return found
