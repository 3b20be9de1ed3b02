"""2,000 fuzzed Generate calls (tests/fuzz_generate.py) against one replica, while a well-formed call of a second
tenant streams beside them: it completes as it would alone, no answer is INTERNAL or UNKNOWN, every refusal's
status fits gRPC's metadata limits, and health answers throughout. Once more (on SQLite) with a KV pool that holds
fewer calls than the slots could fill, so admission plans its blocks and reserves them for refused calls."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc

from billing import commands
from services.inference.device.attention import KVCache
from services.inference.device.checkpoint import read_header
from services.inference.device.executor import ExecutorConfig
from services.inference.serve_config import ServeConfig
from tests.billing.conftest import ledger, postgres_schema_url, sqlite_template  # noqa: F401 - fixtures
from tests.fuzz_generate import GenerateFuzzer, Tally, send
from tests.inference.harness import ServerThread
from tests.inference.test_usage import ledger_rows

NUM_CALLS = 2000
CONCURRENCY = 24
SEED = 20240611
STEADY = pb.GenerateRequest(
    prompt="def add(a, b):\n    return", max_tokens=48, temperature=0.0, labels={"team": "steady"}
)


PLANNED_BLOCKS = 24  # a call and a half of the 256-token context (16 blocks); the 4 slots could fill 64


@pytest.fixture(params=["ample", "planned"])
def kv_memory_bytes(request, ledger, chatml_dir) -> int | None:  # noqa: F811 - the ledger fixture
    """The pool: as the executor sizes it (ample: blocks never bind), or one admission plans (on SQLite only: the
    ledger is not what it exercises)."""
    if request.param == "ample":
        return None
    if not ledger.url.startswith("sqlite"):
        pytest.skip("the planned pool is fuzzed once, on SQLite")
    a = read_header(chatml_dir).args
    per_block = KVCache.bytes_per_block(a.num_hidden_layers, a.num_key_value_heads, 16, a.head_dim, torch.float32)
    return (PLANNED_BLOCKS + 1) * per_block  # the scratch block is in the budget too


@pytest.fixture
def server(ledger, chatml_dir, kv_memory_bytes):  # noqa: F811 - the ledger fixture: SQLite and PostgreSQL
    key = commands.create_tenant(ledger.url, "acme")
    sizes = {} if kv_memory_bytes is None else {"kv_memory_bytes": kv_memory_bytes}
    executor = ExecutorConfig(max_batch=4, max_seq_len=256, **sizes)
    s = ServerThread(ServeConfig(str(chatml_dir), port=0, ledger_url=ledger.url, executor=executor))
    s.key = key
    s.start()
    assert s.replica.service.kv.planned == (kv_memory_bytes is not None)
    yield s
    s.stop()


def _tokens(replies) -> list[int]:
    return [t for r in replies if r.WhichOneof("kind") == "chunk" for t in r.chunk.token_ids]


async def _steady(address: str, key: str, expected: list[int], stop: asyncio.Event, done: list, problems: list):
    """The second tenant's calls, one after another until the fuzz ends; each must stream what it streams alone.
    A refusal for load is retried after its hint, as the SDK does."""
    metadata = (("authorization", f"Bearer {key}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        while not stop.is_set() or not done:
            try:
                replies = [r async for r in stub.Generate(STEADY, timeout=60, metadata=metadata)]
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    await asyncio.sleep(0.05)
                    continue
                problems.append(f"steady call: {error.code().name} {error.details()}")
                return
            if _tokens(replies) != expected or replies[-1].WhichOneof("kind") != "final":
                problems.append(f"steady call streamed {_tokens(replies)}, alone it streams {expected}")
                return
            done.append(replies[-1].final.usage.prompt_tokens)


async def _health(address: str, stop: asyncio.Event, answers: list, problems: list) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(service="zeroqueue.inference.v1.Inference"), timeout=5
                )
            except grpc.aio.AioRpcError as error:
                problems.append(f"health: {error.code().name} {error.details()}")
                return
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                problems.append(f"health: {reply.status}")
            answers.append(time.monotonic() - t0)
            await asyncio.sleep(0.1)


async def _fuzz(server: ServerThread, beta_key: str, expected: list[int]) -> tuple[Tally, list, list, list]:
    tally, problems, done, health_answers = Tally(), [], [], []
    stop = asyncio.Event()
    card = server.replica.service.card
    fuzzer = GenerateFuzzer(SEED, card.name, card.context_length, card.vocab_size, max_request_bytes=128 << 10)
    metadata = (("authorization", f"Bearer {server.key}"),)
    side = [
        asyncio.create_task(_steady(server.address, beta_key, expected, stop, done, problems)),
        asyncio.create_task(_health(server.address, stop, health_answers, problems)),
    ]
    async with grpc.aio.insecure_channel(
        server.address, options=[("grpc.max_send_message_length", 8 << 20)]
    ) as channel:
        calls = iter(fuzzer.calls(NUM_CALLS))

        async def worker() -> None:
            for call in calls:
                tally.add(await send(channel, call, metadata, timeout=5.0))

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    stop.set()
    await asyncio.wait_for(asyncio.gather(*side), 120)
    return tally, problems, done, health_answers


@pytest.mark.slow
def test_fuzzed_calls_beside_a_second_tenant(server):
    beta_key = commands.create_tenant(server.config.ledger_url, "beta")
    alone = list(server.stub(key=beta_key).Generate(STEADY, timeout=60))
    expected = _tokens(alone)
    assert len(expected) == STEADY.max_tokens

    tally, problems, done, health_answers = asyncio.run(_fuzz(server, beta_key, expected))
    print(tally.report())
    assert tally.total == NUM_CALLS
    assert not problems, problems
    assert tally.num_failures == 0, tally.report()
    assert done and all(n == alone[-1].final.usage.prompt_tokens for n in done)
    assert health_answers and max(health_answers) < 5
    assert tally.max_status_bytes < 8 << 10
    assert tally.counts.get(("INVALID_ARGUMENT", "MALFORMED_REQUEST"), 0) > 100  # the bytes were fuzzed
    assert sum(n for (code, _), n in tally.counts.items() if code == "OK") > 100  # and valid calls were served
    deadline = time.monotonic() + 10
    while server.replica.service.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.replica.service.in_flight
    # the engine child's block pool, as its last step reported it: no call holds a KV block any more
    sample = server.replica.metrics.registry.get_sample_value
    assert sample("zeroqueue_kv_blocks", {"state": "used"}) == 0
    assert sample("zeroqueue_kv_blocks", {"state": "cached"}) + sample("zeroqueue_kv_blocks", {"state": "free"}) == (
        server.replica.service.card.kv_blocks
    )
    server.stop()  # the outbox drains into the ledger
    billed = ledger_rows(server.config.ledger_url, "SELECT COUNT(*) FROM usage_records")[0][0]
    assert billed == tally.num_admitted + len(done) + 1  # every admitted call once: fuzzed, steady, alone
