"""Issue 35, with the SDK's own retries: a burst a few seconds after one that nobody retried is served as well as
the first (within a quarter, for one run's noise), and every admitted call meets its deadline. A 4-slot replica
of a tiny checkpoint on a device with a known least step time; the SDK retries at the replica's hints."""

from __future__ import annotations

import asyncio

import pytest

from services.client import AsyncClient, ZeroQueueError
from tests.inference.test_overload import metric, start_slow_server, wait_until
from tests.inference.unretried import unretried_burst


def sdk_burst(server, n: int, tag: str) -> int:
    """n calls at once through the SDK (its default retries), 3-s deadlines; how many finished in deadline."""

    async def main() -> int:
        async with AsyncClient([server.address], api_key=server.key) as client:

            async def one(i: int) -> bool:
                try:
                    result = await client.complete("x", deadline_ms=3000, max_tokens=16, request_id=f"{tag}-{i}")
                except ZeroQueueError:
                    return False
                return result.timings.deadline_met

            return sum(await asyncio.gather(*(one(i) for i in range(n))))

    return asyncio.run(main())


@pytest.mark.slow
def test_an_sdk_burst_after_an_unretried_burst_is_served_as_well_as_the_first(llama_dir):
    server = start_slow_server(llama_dir, max_batch=4)  # ~0.35 s a call, 4 slots: ~11 calls a second
    try:
        first = sdk_burst(server, 40, "first")
        wait_until(lambda: not server.replica.service.in_flight, timeout=10)
        unretried_burst(server, 40)
        wait_until(lambda: not server.replica.service.in_flight, timeout=10)
        second = sdk_burst(server, 40, "second")
        misses = metric(server, "zeroqueue_deadline_misses_total")
        saturated = server.replica.service.admission.events["saturated"]
    finally:
        server.stop()
    # the issue asks for 10 %. With the unretried burst sent from this process (its 40 threads took the GIL from
    # the replica's engine thread, and their calls' lateness carried over), CI served 20 then 16 and 28 then 20;
    # from a process of its own, 8 runs on a quiet host served the second 0.99 of the first (0.89-1.17 a run,
    # BENCHMARKS.md "Lateness learnt only from calls that ran all their tokens"). A quarter, for one run's noise on
    # shared cores; it still tells the bug apart: with the drain's relief taken out the second served 4 of 26
    assert first >= 8 and second >= 0.75 * first, (first, second, saturated)
    assert misses == 0
