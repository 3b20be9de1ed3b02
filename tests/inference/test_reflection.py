"""Reflection describes a method by its full name (`grpcurl describe pkg.Service.Method`), which grpcio-reflection
alone cannot (grpc/grpc#34743): asked the way grpcurl asks, through a reflection-backed descriptor database."""
from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.inference.test_overload import start_slow_server


@pytest.fixture(scope="module")
def replica(llama_dir):
    server = start_slow_server(llama_dir)       # embedded metering: the replica hosts Metering as well
    yield server
    server.stop()


def file_containing(address: str, symbol: str) -> reflection_pb2.ServerReflectionResponse:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
        return next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))


@pytest.mark.parametrize("method, proto, request_type", [
    ("zeroqueue.inference.v1.Inference.Generate", "zeroqueue/inference/v1/inference.proto",
     "zeroqueue.inference.v1.GenerateRequest"),
    ("zeroqueue.metering.v1.Metering.RecordUsage", "zeroqueue/metering/v1/metering.proto",
     "zeroqueue.metering.v1.RecordUsageRequest"),
    ("grpc.health.v1.Health.Check", "grpc_health/v1/health.proto", "grpc.health.v1.HealthCheckRequest"),
])
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
