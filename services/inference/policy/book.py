"""The replica's copy of the serving policy (billing/policy.py): classes of service, prices, tenants' weights and
quotas. It starts as ServingPolicy() (the standard class, no caps) and is read again every `refresh_s` in the
background: from the ledger on a worker thread (embedded), or with the metering service's GetServingPolicy under
the replica's admin key (remote). Calls only ever read `policy`, a frozen object swapped whole: nothing of a
refresh runs in a call's path, and a failed refresh keeps the last policy, logs and counts it, and fails no call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog

from billing.policy import ServingPolicy

log = structlog.get_logger(__name__)
DEFAULT_REFRESH_S = 2.0
READ_TIMEOUT_S = 5.0

Reader = Callable[[], Awaitable[ServingPolicy]]
Listener = Callable[[ServingPolicy], None]


def ledger_reader(sessions) -> Reader:
    """Reads the policy from the ledger (billing.serving_policy) on a worker thread, never on the event loop."""
    from billing.db import ledger_errors, unit_of_work

    def read_sync() -> ServingPolicy:
        from billing.serving_policy import read_serving_policy

        with ledger_errors(), unit_of_work(sessions) as session:  # read-only: the commit ends it
            return read_serving_policy(session, time.time_ns() // 1000)

    async def read() -> ServingPolicy:
        return await asyncio.to_thread(read_sync)

    return read


def remote_reader(channel, admin_key: str, timeout_s: float = READ_TIMEOUT_S) -> Reader:
    """Reads the policy with the metering service's GetServingPolicy (admin keys only) over `channel`."""
    from zeroqueue.metering.v1 import metering_pb2, metering_pb2_grpc

    stub = metering_pb2_grpc.MeteringStub(channel)
    metadata = (("authorization", f"Bearer {admin_key}"),)

    async def read() -> ServingPolicy:
        from services.metering.policy_wire import policy_from_proto

        request = metering_pb2.GetServingPolicyRequest()
        reply = await stub.GetServingPolicy(request, metadata=metadata, timeout=timeout_s)
        return policy_from_proto(reply)

    return read


def _seen(done: asyncio.Future) -> None:
    if not done.cancelled():
        done.exception()  # a failed read nobody waited for any more is not "never retrieved"


def weights_of(policy: ServingPolicy) -> dict[str, float]:
    """Each tenant's weight in fair share, as admission takes them (a tenant not listed weighs 1)."""
    return {tenant: float(quota.weight) for tenant, quota in policy.tenants.items()}


class PolicyBook:
    """Holds the latest ServingPolicy. `on_refresh(ok)` is told each refresh's result (metrics); listeners get each
    policy read, and the current one when they subscribe (admission's weights)."""

    def __init__(
        self,
        read: Reader | None = None,
        refresh_s: float = DEFAULT_REFRESH_S,
        on_refresh: Callable[[bool, ServingPolicy], None] | None = None,
    ) -> None:
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self.policy = ServingPolicy()
        self.read, self.refresh_s, self.on_refresh = read, refresh_s, on_refresh
        self.listeners: list[Listener] = []
        self.failures = 0  # consecutive failed refreshes
        self._task: asyncio.Task | None = None
        self._reading: asyncio.Future | None = None  # the read in progress, which a late refresh waits on
        self._first: asyncio.Event | None = None  # set once the first refresh has ended, read or failed

    def subscribe(self, listener: Listener) -> None:
        self.listeners.append(listener)
        self._tell(listener, self.policy)

    async def refresh(self) -> bool:
        """Reads the policy once; on failure keeps the last one. Returns whether the read succeeded."""
        if self.read is None:
            return True
        # one read at a time: a read that outlives its wait goes on, and the next refresh waits on it rather than
        # start another (a hung ledger holds one worker thread, never one more each refresh)
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self.read())
            self._reading.add_done_callback(_seen)
        try:
            policy = await asyncio.wait_for(asyncio.shield(self._reading), READ_TIMEOUT_S * 2)
        except Exception as error:  # noqa: BLE001 - whatever the ledger or the network said: keep serving
            self.failures += 1
            # one warning when refreshes start failing, then debug lines (the metric counts every one)
            emit = log.warning if self.failures == 1 else log.debug
            emit("policy_refresh_failed", error=f"{type(error).__name__}: {error}"[:256], failures=self.failures)
            if self.on_refresh is not None:
                self.on_refresh(False, self.policy)
            return False
        if self.failures:
            log.info("policy_refresh_recovered", after_failures=self.failures)
        self.failures = 0
        self.policy = policy
        for listener in self.listeners:
            self._tell(listener, policy)
        if self.on_refresh is not None:
            self.on_refresh(True, policy)
        return True

    @staticmethod
    def _tell(listener: Listener, policy: ServingPolicy) -> None:
        try:
            listener(policy)
        except Exception:  # noqa: BLE001 - a listener's bug must not stop the refreshes
            log.exception("policy_listener_failed")

    def start(self) -> None:
        """Reads at once, then every refresh_s, until stop()."""
        if self.read is not None and self._task is None:
            self._first = asyncio.Event()
            self._task = asyncio.create_task(self._run())

    async def first_read(self) -> bool:
        """Waits for the first refresh to end (it is bounded by its own timeout); whether a policy was read. A
        replica says SERVING only after it, so that its first calls meet the ledger's classes and caps."""
        if self._first is not None:
            await self._first.wait()
        return self.failures == 0

    async def _run(self) -> None:
        while True:
            await self.refresh()
            if self._first is not None:
                self._first.set()
            await asyncio.sleep(self.refresh_s)

    async def stop(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
