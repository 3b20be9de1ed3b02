"""The shipper's gRPC sink: a batch the metering service refuses for its content is halved until the record at
fault stands alone and is dead-lettered; the others are delivered. Any other refusal keeps the whole batch."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from zeroqueue.metering.v1 import metering_pb2 as pb

from billing.records import Door, RequestKind
from services.metering.shipper import Delivery, GrpcSink, SinkUnavailable
from tests.metering.test_outbox import builder


class FakeStub:
    """RecordUsage that refuses, with `code`, any batch holding a record whose id is in `poison`."""

    def __init__(self, poison: set[str], code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        self.poison, self.code = poison, code
        self.batches: list[list[str]] = []
        self.kinds: dict[str, str] = {}
        self.doors: dict[str, str] = {}
        self.cached: dict[str, int] = {}
        self.weight_dtypes: dict[str, str] = {}

    async def RecordUsage(self, request, metadata, timeout):  # noqa: N802 - the stub's method
        ids = [r.call_id for r in request.records]
        self.batches.append(ids)
        self.kinds.update((r.call_id, r.request_kind) for r in request.records)
        self.doors.update((r.call_id, r.door) for r in request.records)
        self.cached.update((r.call_id, r.cached_prompt_tokens) for r in request.records)
        self.weight_dtypes.update((r.call_id, r.weight_dtype) for r in request.records)
        if self.poison & set(ids):
            raise grpc.aio.AioRpcError(
                self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="records[0].unit_us is out of range"
            )
        return pb.RecordUsageResponse(records=[pb.RecordResult(id=i, status=pb.RECORD_STATUS_ACCEPTED) for i in ids])


def sink_with(stub: FakeStub) -> GrpcSink:
    sink = GrpcSink.__new__(GrpcSink)
    sink.stub, sink.metadata, sink.timeout_s = stub, (), 1.0
    return sink


@pytest.mark.parametrize("poison", [set(), {"r0"}, {"r37"}, {"r63"}, {"r5", "r6", "r50"}])
def test_a_refused_batch_is_halved_until_only_the_records_at_fault_are_dead(poison):
    records = [builder(f"r{i}")() for i in range(64)]
    stub = FakeStub(poison)
    acks = asyncio.run(sink_with(stub).deliver(records, []))
    assert sorted(a.record_id for a in acks) == sorted(r.call_id for r in records)  # each acked once
    dead = {a.record_id for a in acks if a.delivery is Delivery.DEAD}
    assert dead == poison
    assert all("INVALID_ARGUMENT" in a.reason for a in acks if a.delivery is Delivery.DEAD)
    # bisection: a few calls per record at fault, never one call per record
    assert len(stub.batches) <= 1 + 2 * len(poison) * 6


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.FAILED_PRECONDITION,
    ],
)
def test_any_other_refusal_keeps_the_whole_batch_for_a_retry(code):
    stub = FakeStub({"r1"}, code)
    with pytest.raises(SinkUnavailable, match=code.name):
        asyncio.run(sink_with(stub).deliver([builder(f"r{i}")() for i in range(4)], []))
    assert len(stub.batches) == 1


def test_each_record_goes_with_its_request_kind():
    stub = FakeStub(set())
    records = [builder(f"r-{kind.value}")(request_kind=kind) for kind in RequestKind]
    acks = asyncio.run(sink_with(stub).deliver(records, []))
    assert {a.delivery for a in acks} == {Delivery.DELIVERED}
    assert stub.kinds == {f"r-{kind.value}": kind.value for kind in RequestKind}


def test_each_record_goes_with_its_door():
    stub = FakeStub(set())
    records = [builder(f"r-{door.value}")(door=door) for door in Door]
    acks = asyncio.run(sink_with(stub).deliver(records, []))
    assert {a.delivery for a in acks} == {Delivery.DELIVERED}
    assert stub.doors == {f"r-{door.value}": door.value for door in Door}


def test_each_record_goes_with_its_cached_prompt_tokens():
    stub = FakeStub(set())
    records = [builder(f"r-{cached}")(cached_prompt_tokens=cached) for cached in range(4)]  # of 3 prompt tokens
    acks = asyncio.run(sink_with(stub).deliver(records, []))
    assert {a.delivery for a in acks} == {Delivery.DELIVERED}
    assert stub.cached == {f"r-{cached}": cached for cached in range(4)}


def test_each_record_goes_with_its_weight_dtype():
    stub = FakeStub(set())
    dtypes = {"r-int8": "int8", "r-bf16": "bfloat16", "r-unknown": ""}  # '': a record queued before weight dtypes
    records = [builder(call_id)(weight_dtype=dtype) for call_id, dtype in dtypes.items()]
    acks = asyncio.run(sink_with(stub).deliver(records, []))
    assert {a.delivery for a in acks} == {Delivery.DELIVERED}
    assert stub.weight_dtypes == dtypes
