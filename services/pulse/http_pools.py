"""The HTTP client's connections: keep-alive HTTP/1.1 pools of httpx.AsyncClient, together sized for the calls open at
once, each at most POOL_CONNECTIONS.

Why several: httpcore's connection pool does work in the product of its requests and its connections at every event
(for each idle connection it counts all the others, and it polls each one's socket), so one pool of 150 busy
connections cost pulse ~13 ms of CPU per call, and at 150 calls a second its event loop fell seconds behind the
schedule (measured against a server answering in 1 s). Pools of 16 keep that work small; a call's attempt takes the
pool with the fewest calls in it, and a new pool is made only when every pool is full.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import httpx

POOL_CONNECTIONS = 16
KEEPALIVE_S = 4.0  # under uvicorn's default 5 s: an idle connection is dropped here before the server drops it


class HttpPools:
    def __init__(
        self,
        max_connections: int,
        verify: object = True,
        transport: httpx.AsyncBaseTransport | None = None,
        pool_connections: int = POOL_CONNECTIONS,
    ) -> None:
        if max_connections < 1 or pool_connections < 1:
            raise ValueError("max_connections and pool_connections must be >= 1")
        self.pool_size = min(pool_connections, max_connections)
        self.max_pools = math.ceil(max_connections / self.pool_size)
        # one TLS context for every pool: httpx would load the CA bundle again for each
        self.verify = httpx.create_ssl_context() if verify is True else verify
        self.transport = transport
        self.clients: list[httpx.AsyncClient] = []
        self.in_flight: list[int] = []

    def _new(self) -> int:
        limits = httpx.Limits(
            max_connections=self.pool_size, max_keepalive_connections=self.pool_size, keepalive_expiry=KEEPALIVE_S
        )
        client = httpx.AsyncClient(limits=limits, verify=self.verify, transport=self.transport, trust_env=False)
        self.clients.append(client)
        self.in_flight.append(0)
        return len(self.clients) - 1

    def _pick(self) -> int:
        if self.in_flight:
            least = min(range(len(self.in_flight)), key=self.in_flight.__getitem__)
            if self.in_flight[least] < self.pool_size or len(self.clients) >= self.max_pools:
                return least
        return self._new()

    @contextlib.contextmanager
    def lease(self) -> Iterator[httpx.AsyncClient]:
        """The client an attempt sends through, counted as busy until the attempt is answered."""
        index = self._pick()
        self.in_flight[index] += 1
        try:
            yield self.clients[index]
        finally:
            self.in_flight[index] -= 1

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()
