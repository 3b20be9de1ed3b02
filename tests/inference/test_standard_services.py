"""grpcio's standard services on a replica: malformed or oversized bytes to health and reflection get the same
precise INVALID_ARGUMENT / OUT_OF_RANGE as zeroqueue's own methods (never UNKNOWN), health and its Watch still
answer, and reflection describes a method by its full name (`grpcurl describe pkg.Service.Method`), which
grpcio-reflection alone cannot (grpc/grpc#34743): asked the way grpcurl asks, through a reflection-backed
descriptor database."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.standard import MAX_REQUEST_BYTES
from tests.inference.harness import status_details
from tests.inference.test_overload import start_slow_server

REFLECTION_INFO = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
MALFORMED = [b"\xff\xff", b"\x0a\x03\xff\xfe\xfd", b"\x0a\x80"]  # a bad tag, bad UTF-8, a cut varint


@pytest.fixture(scope="module")
def replica(llama_dir):
    server = start_slow_server(llama_dir)  # embedded metering: the replica hosts Metering as well
    yield server
    server.stop()


def file_containing(address: str, symbol: str) -> reflection_pb2.ServerReflectionResponse:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
        return next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))


@pytest.mark.parametrize(
    "method, proto, request_type",
    [
        (
            "zeroqueue.inference.v1.Inference.Generate",
            "zeroqueue/inference/v1/inference.proto",
            "zeroqueue.inference.v1.GenerateRequest",
        ),
        (
            "zeroqueue.metering.v1.Metering.RecordUsage",
            "zeroqueue/metering/v1/metering.proto",
            "zeroqueue.metering.v1.RecordUsageRequest",
        ),
        ("grpc.health.v1.Health.Check", "grpc_health/v1/health.proto", "grpc.health.v1.HealthCheckRequest"),
    ],
)
def test_a_method_is_described_by_its_full_name(replica, method, proto, request_type):
    with grpc.insecure_channel(replica.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert database.FindFileContainingSymbol(method).name == proto
        described = descriptor_pool.DescriptorPool(database).FindMethodByName(method)
    assert described.input_type.full_name == request_type


def test_services_and_messages_still_resolve_and_unknown_symbols_are_not_found(replica):
    for symbol in ("zeroqueue.inference.v1.Inference", "zeroqueue.inference.v1.GenerateRequest"):
        reply = file_containing(replica.address, symbol)
        assert reply.WhichOneof("message_response") == "file_descriptor_response", symbol
    for symbol in ("zeroqueue.inference.v1.Inference.NoSuchMethod", "no.such.Thing"):
        reply = file_containing(replica.address, symbol)
        assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0], symbol


def refusal(error: grpc.RpcError, code: grpc.StatusCode, reason: str, message_type: str) -> None:
    assert isinstance(error, grpc.RpcError) and error.code() == code, error
    info = status_details(error)["ErrorInfo"]
    assert info.reason == reason and info.metadata["message_type"] == message_type


def health_check(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return (
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        )


@pytest.mark.parametrize("raw", MALFORMED)
@pytest.mark.parametrize("method, streaming", [("Check", False), ("Watch", True)])
def test_malformed_health_requests_are_invalid_argument(replica, raw, method, streaming):
    with grpc.insecure_channel(replica.address) as channel:
        call = (channel.unary_stream if streaming else channel.unary_unary)(f"/grpc.health.v1.Health/{method}")
        with pytest.raises(grpc.RpcError) as caught:
            reply = call(raw, timeout=10)
            if streaming:
                next(iter(reply))
    refusal(caught.value, grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST", "grpc.health.v1.HealthCheckRequest")
    assert health_check(replica.address) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("raw", [b"", *MALFORMED])
def test_health_list_which_grpcio_does_not_implement_for_asyncio_is_unimplemented(replica, raw):
    with grpc.insecure_channel(replica.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/grpc.health.v1.Health/List")(raw, timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_an_oversized_health_request_is_refused_by_size_before_parsing(replica):
    request = health_pb2.HealthCheckRequest(service="s" * MAX_REQUEST_BYTES).SerializeToString()
    with grpc.insecure_channel(replica.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/grpc.health.v1.Health/Check")(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert status_details(caught.value)["ErrorInfo"].reason == "REQUEST_TOO_LARGE"


def test_health_watch_still_streams_the_status(replica):
    with grpc.insecure_channel(replica.address) as channel:
        replies = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(iter(replies)).status == health_pb2.HealthCheckResponse.SERVING
        replies.cancel()


def test_a_malformed_reflection_message_ends_its_stream_with_invalid_argument(replica):
    good = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    with grpc.insecure_channel(replica.address) as channel:
        replies = channel.stream_stream(REFLECTION_INFO)(iter([good, b"\xff\xff"]), timeout=10)
        first = reflection_pb2.ServerReflectionResponse.FromString(next(replies))
        assert "zeroqueue.inference.v1.Inference" in {s.name for s in first.list_services_response.service}
        with pytest.raises(grpc.RpcError) as caught:
            next(replies)
    refusal(
        caught.value,
        grpc.StatusCode.INVALID_ARGUMENT,
        "MALFORMED_REQUEST",
        "grpc.reflection.v1alpha.ServerReflectionRequest",
    )
    assert file_containing(replica.address, "zeroqueue.inference.v1.Inference").file_descriptor_response
