"""A call's budget from its gRPC deadline: never more time than the caller gave, whatever gRPC's timeout header
rounded it up to on the way."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio

from services.inference.servicer import caller_budget_s

TIMEOUTS_S = (0.25, 0.999, 1.0, 2.0, 2.5, 9.5, 30.0, 150.0)


async def budgets_seen(timeouts_s: tuple[float, ...]) -> list[float]:
    """caller_budget_s of each call's time_remaining() as a real grpc.aio server sees it."""
    seen: list[float] = []

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        seen.append(caller_budget_s(context.time_remaining()))
        return b""

    server = aio.server()
    method = grpc.unary_unary_rpc_method_handler(handler)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Budget", {"Seen": method}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.Budget/Seen")
            for timeout_s in timeouts_s:
                await call(b"", timeout=timeout_s)
    finally:
        await server.stop(None)
    return seen


def test_the_budget_is_never_more_than_the_callers_deadline():
    seen = asyncio.run(budgets_seen(TIMEOUTS_S))
    for timeout_s, budget_s in zip(TIMEOUTS_S, seen, strict=True):
        assert budget_s <= timeout_s, f"a {timeout_s}-s deadline became a {budget_s:.4f}-s budget"
        assert budget_s > timeout_s * 0.5  # and most of it is kept (the rest is the host's delay, and the unit)


@pytest.mark.parametrize(
    ("remaining_s", "budget_s"),
    [(None, None), (0.5, 0.499), (2.009, 1.999), (30.093, 29.993), (200.0, 198.0), (0.0005, 0.0005), (-1.0, -1.0)],
)
def test_the_unit_taken_off_is_the_one_grpc_rounds_to(remaining_s, budget_s):
    assert caller_budget_s(remaining_s) == pytest.approx(budget_s)
