"""Client-side interceptors that attach `authorization: Bearer <key>` to every call."""

from __future__ import annotations

import collections

import grpc

_Details = collections.namedtuple(
    "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
)


def _with_key(details: grpc.ClientCallDetails, key: str) -> _Details:
    metadata = [*(details.metadata or ()), ("authorization", f"Bearer {key}")]
    return _Details(
        details.method,
        details.timeout,
        metadata,
        details.credentials,
        getattr(details, "wait_for_ready", None),
        getattr(details, "compression", None),
    )


class BearerAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """For grpc (sync) channels: `grpc.intercept_channel(channel, BearerAuth(key))`."""

    def __init__(self, key: str) -> None:
        self.key = key

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_key(details, self.key), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_key(details, self.key), request)


def authorized_channel(address: str, key: str, options: list | None = None) -> grpc.Channel:
    return grpc.intercept_channel(grpc.insecure_channel(address, options=options or []), BearerAuth(key))
