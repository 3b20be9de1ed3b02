"""grpcio's standard services, health and reflection, registered through services/parsing.py.

Their generated add_XServicer_to_server parses a request before any handler runs, so malformed bytes come back
UNKNOWN "Unexpected DecodeError"; registered through services/parsing.add_servicer they get the same precise
INVALID_ARGUMENT (MALFORMED_REQUEST) as every zeroqueue method, and requests are bounded by size first.

Reflection also answers for a method's full name.

grpcio-reflection looks a symbol up with the descriptor pool's FindFileContainingSymbol, which knows messages,
enums, services and fields but not methods (grpc/grpc#34743): `grpcurl describe pkg.Service.Method` then fails
with "Symbol not found". The servicer reads symbols only through the pool it is given, so a pool that also
resolves methods fixes every lookup (file_containing_symbol) without touching grpcio-reflection's internals.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

from services.parsing import add_servicer

# a health or reflection request is a service or symbol name: well under this, whatever the client
MAX_REQUEST_BYTES = 4096
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]


class MethodAwarePool:
    """A descriptor pool (the default one unless given) whose FindFileContainingSymbol also resolves
    `pkg.Service.Method` to the file of its service; everything else is the wrapped pool's."""

    def __init__(self, pool: descriptor_pool.DescriptorPool | None = None) -> None:
        self._pool = pool if pool is not None else descriptor_pool.Default()

    def __getattr__(self, name: str):
        return getattr(self._pool, name)

    def FindFileContainingSymbol(self, full_name: str):  # noqa: N802 - the DescriptorPool method it stands in for
        try:
            return self._pool.FindFileContainingSymbol(full_name)
        except KeyError:
            # not a message, enum, service or field: perhaps a method (KeyError again if not, which the
            # servicer answers NOT_FOUND)
            return self._pool.FindMethodByName(full_name).containing_service.file


def add_health(server: grpc.aio.Server, servicer: health_aio.HealthServicer) -> None:
    """health_pb2_grpc.add_HealthServicer_to_server, with requests parsed (and bounded) in the handler."""
    add_servicer(server, HEALTH, servicer, MAX_REQUEST_BYTES)


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """grpc_reflection's enable_server_reflection, with method names resolved too and requests parsed (and
    bounded) in the handler."""
    servicer = reflection.aio.ReflectionServicer(tuple(service_names), pool=MethodAwarePool())
    add_servicer(server, REFLECTION, servicer, MAX_REQUEST_BYTES)


SERVICE_NAMES = (HEALTH.full_name, reflection.SERVICE_NAME)  # what a host lists beside its own services
