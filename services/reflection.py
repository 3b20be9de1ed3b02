"""gRPC server reflection that also answers for a method's full name.

grpcio-reflection looks a symbol up with the descriptor pool's FindFileContainingSymbol, which knows messages,
enums, services and fields but not methods (grpc/grpc#34743): `grpcurl describe pkg.Service.Method` then fails
with "Symbol not found". The servicer reads symbols only through the pool it is given, so a pool that also
resolves methods fixes every lookup (file_containing_symbol) without touching grpcio-reflection's internals.
"""
from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection

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


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server | grpc.Server) -> None:
    """grpc_reflection's enable_server_reflection, with method names resolved too."""
    reflection.enable_server_reflection(tuple(service_names), server, pool=MethodAwarePool())
