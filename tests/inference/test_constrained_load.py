"""Constrained calls under overload: with twice as many callers as slots, half of them sending JSON Schema calls
(masked every step) and half plain ones, the calls admitted meet their deadlines as often as plain calls do: the
mask's cost is in the prediction (calibrated at warm-up), not a surprise that makes constrained calls late."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc

from services.inference.bundled_model import BUNDLED_MODEL
from services.inference.device.executor import ExecutorConfig
from services.inference.serve_config import ServeConfig
from tests.inference.harness import ServerThread

SLOTS = 4
SECONDS = 8.0
BUDGET_S = 0.6
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}}}
        },
    }
)
PLAIN = pb.GenerateRequest(prompt="def parse(text):\n", max_tokens=48, temperature=0.0)
CONSTRAINED = pb.GenerateRequest(
    prompt="def parse(text):\n", max_tokens=48, temperature=0.0, response_format=pb.ResponseFormat(json_schema=SCHEMA)
)


async def caller(stub, request, metadata, until: float, tally: dict) -> None:
    """Sends `request` again and again until `until`; refused calls wait their hint, as the SDK does. An admitted
    call that the client's own deadline ends counts as admitted and late."""
    while time.monotonic() < until:
        replies = []
        try:
            async for reply in stub.Generate(request, timeout=BUDGET_S, metadata=metadata):
                replies.append(reply)
        except grpc.aio.AioRpcError as error:
            if replies and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                tally["admitted"] += 1
            elif error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # no reply at all in time: the callers and the replica share one process (and its GIL) here, so a
                # caller may not read its answer before its own timer; not admission's doing, and not a late call
                tally["unanswered"] += 1
            elif error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                tally["refused"] += 1
                await asyncio.sleep(0.02)
            else:
                tally["failed"].append(f"{error.code().name}: {error.details()}")
            continue
        tally["admitted"] += 1
        tally["met"] += replies[-1].final.timings.deadline_met


async def overload(server: ServerThread) -> dict[str, dict]:
    metadata = (("authorization", f"Bearer {server.key}"),)
    kinds = ("plain", "constrained")
    tallies = {name: {"admitted": 0, "met": 0, "refused": 0, "unanswered": 0, "failed": []} for name in kinds}
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        # the schema compiled once before the clock starts: this measures masks under load, not a first compile
        await stub.Generate(CONSTRAINED, timeout=30, metadata=metadata).read()
        until = time.monotonic() + SECONDS
        await asyncio.gather(
            *(caller(stub, PLAIN, metadata, until, tallies["plain"]) for _ in range(SLOTS)),
            *(caller(stub, CONSTRAINED, metadata, until, tallies["constrained"]) for _ in range(SLOTS)),
        )
    return tallies


@pytest.mark.slow
def test_admitted_constrained_calls_meet_their_deadlines_as_plain_calls_do():
    server = ServerThread(
        ServeConfig(str(BUNDLED_MODEL), port=0, dtype="bfloat16", hold=False, executor=ExecutorConfig(max_batch=SLOTS))
    ).start()
    try:
        tallies = asyncio.run(overload(server))
    finally:
        server.stop()
    plain, constrained = tallies["plain"], tallies["constrained"]
    assert not plain["failed"] and not constrained["failed"], (plain["failed"][:3], constrained["failed"][:3])
    assert plain["refused"] + constrained["refused"] > 0, "not an overload: nothing was refused"
    assert plain["admitted"] >= 10 and constrained["admitted"] >= 10, tallies
    plain_rate, constrained_rate = plain["met"] / plain["admitted"], constrained["met"] / constrained["admitted"]
    assert plain_rate >= 0.9 and constrained_rate >= plain_rate - 0.05, tallies
