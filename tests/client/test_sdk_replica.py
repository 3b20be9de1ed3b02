"""The SDK against a real replica (in process, a fake slow device): a real refusal, its hint honoured, the
retry admitted, and the replica's retry dashboard counting what x-retry-attempt told it."""

from __future__ import annotations

import asyncio

import pytest

from services.client import AsyncClient, Client, InvalidRequest
from tests.inference.test_overload import fill, metric, start_slow_server


@pytest.fixture(scope="module")
def server(llama_dir):
    s = start_slow_server(llama_dir, hold=False)  # the refusal and its hint (with holds, the call would be held)
    yield s
    s.stop()


def retries_counted(server) -> float:
    return sum(
        metric(server, "zeroqueue_retry_attempts_total", attempt="1", result=r)
        for r in ("admitted", "overloaded", "infeasible")
    )


@pytest.mark.slow
def test_a_refused_call_waits_its_hint_and_is_then_served(server):
    running = fill(server, max_tokens=30)  # both KV slots busy
    before = retries_counted(server)
    with Client([server.address], api_key=server.key) as client:
        result = client.complete("x = 1", deadline_ms=10_000, max_tokens=5, temperature=0.0)
    for call in running:
        call.join()
    first, *rest = result.report.attempts
    assert first.outcome == "RESOURCE_EXHAUSTED" and first.reason == "OVERLOADED" and first.retry_after_ms > 0
    assert rest[0].waited_s >= first.retry_after_ms / 1000 and rest[-1].outcome == "admitted"
    assert retries_counted(server) == before + 1
    assert result.usage.completion_tokens == 5 and result.usage.device_us > 0 and result.usage.unit == "core_us"
    assert result.timings.deadline_met and len(result.token_ids) == 5
    assert len(result.admission.call_id) == 32 and result.admission.call_id != result.request_id


@pytest.mark.slow
def test_the_async_client_streams_and_reports_bad_input_by_field(server):
    async def main():
        async with AsyncClient([server.address], api_key=server.key) as client:
            generation = client.generate("def f():", deadline_ms=10_000, max_tokens=4, temperature=0.0)
            chunks = [c async for c in generation]
            with pytest.raises(InvalidRequest) as info:
                await client.complete("def f():", deadline_ms=10_000, max_tokens=4, top_p=1.5)
            return chunks, generation.result, info.value

    chunks, result, error = asyncio.run(main())
    assert sum(len(c.token_ids) for c in chunks) == 4 and result.text == "".join(c.text for c in chunks)
    assert [v.field for v in error.violations] == ["top_p"] and error.report.num_attempts == 1
