"""The metering service alone answers reflection for a method's full name too (grpc/grpc#34743)."""
from __future__ import annotations

from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


def test_a_metering_method_is_described_by_its_full_name(metering) -> None:  # type: ignore[no-untyped-def]
    with metering.channel() as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        found = database.FindFileContainingSymbol("zeroqueue.metering.v1.Metering.RecordUsage")
    assert found.name == "zeroqueue/metering/v1/metering.proto"
