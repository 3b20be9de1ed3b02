"""The metering service alone: reflection answers for a method's full name too (grpc/grpc#34743), and malformed
bytes to health or reflection are INVALID_ARGUMENT with an ErrorInfo, never UNKNOWN."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.inference.harness import status_details


def test_a_metering_method_is_described_by_its_full_name(metering) -> None:  # type: ignore[no-untyped-def]
    with metering.channel() as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        found = database.FindFileContainingSymbol("zeroqueue.metering.v1.Metering.RecordUsage")
    assert found.name == "zeroqueue/metering/v1/metering.proto"


@pytest.mark.parametrize(
    "method", ["/grpc.health.v1.Health/Check", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"]
)
def test_malformed_bytes_to_a_standard_service_are_invalid_argument(metering, method) -> None:  # type: ignore[no-untyped-def]
    with metering.channel() as channel:
        with pytest.raises(grpc.RpcError) as caught:
            if "Reflection" in method:
                next(channel.stream_stream(method)(iter([b"\xff\xff"]), timeout=10))
            else:
                channel.unary_unary(method)(b"\xff\xff", timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert status_details(caught.value)["ErrorInfo"].reason == "MALFORMED_REQUEST"
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
