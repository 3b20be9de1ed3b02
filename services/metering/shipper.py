"""Ships the outbox to the ledger: in batches, with exponential backoff and full jitter while the
ledger is unreachable, marking rows delivered only on the ledger's acknowledgement."""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import structlog
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from zeroqueue.metering.v1 import metering_pb2 as pb
from zeroqueue.metering.v1 import metering_pb2_grpc

from billing import ledger
from billing.db import unit_of_work
from billing.errors import UnknownTenant
from billing.records import IdleRecord, UsageRecord

from .outbox import Outbox
from .servicer import idle_to_pb, usage_to_pb

log = structlog.get_logger(__name__)


class Delivery(enum.Enum):
    DELIVERED = "delivered"  # accepted, or a duplicate of what the ledger holds
    DEAD = "dead"  # conflict or invalid: set aside for review, never retried


@dataclass(frozen=True)
class Ack:
    record_id: str
    delivery: Delivery
    reason: str = ""


class SinkUnavailable(Exception):
    """The ledger could not be reached or refused the whole batch for now; retry later."""


class Sink(Protocol):
    async def deliver(self, usage: Sequence[UsageRecord], idle: Sequence[IdleRecord]) -> list[Ack]: ...


def _ack(result: ledger.IngestResult) -> Ack:
    if result.delivered:
        return Ack(result.record_id, Delivery.DELIVERED)
    return Ack(result.record_id, Delivery.DEAD, f"{result.status.value}: the ledger holds a different payload")


class LedgerSink:
    """Writes straight into a ledger database (one process, or replicas sharing PostgreSQL)."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    async def deliver(self, usage: Sequence[UsageRecord], idle: Sequence[IdleRecord]) -> list[Ack]:
        try:
            return await asyncio.to_thread(self._deliver, list(usage), list(idle))
        except SQLAlchemyError as exc:
            raise SinkUnavailable(str(exc).splitlines()[0]) from exc

    def _deliver(self, usage: list[UsageRecord], idle: list[IdleRecord]) -> list[Ack]:
        acks: list[Ack] = []
        while True:
            try:
                with unit_of_work(self.sessions) as session:
                    results = ledger.ingest_usage(session, usage) + ledger.ingest_idle(session, idle)
                return acks + [_ack(r) for r in results]
            except UnknownTenant as exc:  # only that tenant's records are refused, the rest go in
                acks += [
                    Ack(r.call_id, Delivery.DEAD, f"unknown tenant {exc.tenant!r}")
                    for r in usage
                    if r.tenant == exc.tenant
                ]
                usage = [r for r in usage if r.tenant != exc.tenant]


_DEAD_STATUSES = {pb.RECORD_STATUS_CONFLICT: "conflict", pb.RECORD_STATUS_INVALID: "invalid"}
# a refusal of the batch's content: some record (or the batch's size) is at fault, not the ledger's state. Any
# other code (unreachable, overloaded, a key or an endpoint an operator must fix) keeps the records for a retry
_REFUSES_CONTENT = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


class GrpcSink:
    """Calls Metering.RecordUsage on a metering service, with an admin key."""

    def __init__(self, channel: grpc.aio.Channel, api_key: str, timeout_s: float = 10.0) -> None:
        self.stub = metering_pb2_grpc.MeteringStub(channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),)
        self.timeout_s = timeout_s

    async def deliver(self, usage: Sequence[UsageRecord], idle: Sequence[IdleRecord]) -> list[Ack]:
        """The batch's acks. A batch refused for its content is halved until the records at fault stand alone
        (each then dead-lettered with the refusal): one bad record never holds back the others' delivery."""
        request = pb.RecordUsageRequest(records=[usage_to_pb(r) for r in usage], idle=[idle_to_pb(r) for r in idle])
        try:
            reply = await self.stub.RecordUsage(request, metadata=self.metadata, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _REFUSES_CONTENT:
                raise SinkUnavailable(f"{exc.code().name}: {exc.details()}") from exc
            if len(usage) + len(idle) == 1:
                record_id = usage[0].call_id if usage else idle[0].record_id
                return [Ack(record_id, Delivery.DEAD, f"refused: {exc.code().name}: {exc.details()}")]
            return await self._halves(list(usage), list(idle))
        return [
            Ack(r.id, Delivery.DEAD, f"{_DEAD_STATUSES[r.status]}: {r.message}")
            if r.status in _DEAD_STATUSES
            else Ack(r.id, Delivery.DELIVERED)
            for r in (*reply.records, *reply.idle)
        ]

    async def _halves(self, usage: list[UsageRecord], idle: list[IdleRecord]) -> list[Ack]:
        # a half delivered before the other finds the ledger away is sent again later: the ledger's
        # idempotent ingest acknowledges the repeat as delivered
        if usage and idle:
            return await self.deliver(usage, []) + await self.deliver([], idle)
        if usage:
            middle = len(usage) // 2
            return await self.deliver(usage[:middle], []) + await self.deliver(usage[middle:], [])
        middle = len(idle) // 2
        return await self.deliver([], idle[:middle]) + await self.deliver([], idle[middle:])


class Shipper:
    def __init__(
        self,
        outbox: Outbox,
        sink: Sink,
        batch_size: int = 500,
        poll_s: float = 0.2,
        min_backoff_s: float = 0.05,
        max_backoff_s: float = 30.0,
        rng: random.Random | None = None,
    ) -> None:
        self.outbox, self.sink = outbox, sink
        self.batch_size, self.poll_s = batch_size, poll_s
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.rng = rng or random.Random()
        self.failures = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            shipped = await self.ship_once()
            if shipped is None:  # the ledger is away: back off, with full jitter
                delay = min(self.max_backoff_s, self.min_backoff_s * 2 ** min(self.failures, 20))
                await _wait(stop, self.rng.uniform(0, delay))
            elif shipped == 0:
                await _wait(stop, self.poll_s)

    async def ship_once(self) -> int | None:
        """Delivers one batch; returns how many rows left the outbox, or None when the sink was away."""
        rows = await asyncio.to_thread(self.outbox.pending, self.batch_size)
        if not rows:
            return 0
        usage = [r.record for r in rows if isinstance(r.record, UsageRecord)]
        idle = [r.record for r in rows if isinstance(r.record, IdleRecord)]
        try:
            acks = await self.sink.deliver(usage, idle)
        except SinkUnavailable as exc:
            self.failures += 1
            log.warning("ledger_unavailable", error=str(exc), failures=self.failures, pending=len(rows))
            await asyncio.to_thread(self.outbox.mark_failed, [r.id for r in rows], str(exc))
            return None
        self.failures = 0
        row_ids = {(r.record.call_id if isinstance(r.record, UsageRecord) else r.record.record_id): r.id for r in rows}
        dead = [(row_ids[a.record_id], a.reason) for a in acks if a.delivery is Delivery.DEAD]
        for a in acks:
            if a.delivery is Delivery.DEAD:
                log.error("usage_record_dead_lettered", record_id=a.record_id, reason=a.reason)
        await asyncio.to_thread(
            self.outbox.mark_delivered, [row_ids[a.record_id] for a in acks if a.delivery is Delivery.DELIVERED]
        )
        await asyncio.to_thread(self.outbox.mark_dead, dead)
        return len(acks)

    async def drain(self, timeout_s: float) -> bool:
        """Ships until the outbox is empty or the time is up; True when empty."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while loop.time() < end:
            shipped = await self.ship_once()
            if shipped == 0:
                return True
            if shipped is None:
                await asyncio.sleep(min(self.min_backoff_s * 2 ** min(self.failures, 10), 1.0))
        return False


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass
