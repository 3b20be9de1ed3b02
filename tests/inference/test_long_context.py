"""Long contexts do not cap concurrency: a call holds the KV blocks of its own prompt and max_tokens, not a slot of
max_seq_len, so a replica started with the model's full context keeps its slots, and runs a call near that length
while short calls run beside it. Where the pool has fewer blocks than the slots could fill, admission plans them: a
second long call is admitted at once, held for the start its blocks are planned to free at, and waits for them if
the first call ends late; with `--no-hold-blocks` it is refused for blocks (`kv_blocks`) with the first one's
predicted finish as its hint and its blocks reserved from then, so its retry at the hint is served. FIFO admission
starts it once the first one's blocks are back. The pool is empty of calls at the end."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from zeroqueue.inference.v1 import inference_pb2 as pb

from services.inference.device.attention import KVCache
from services.inference.device.executor import Executor, ExecutorConfig
from services.inference.device.loader import load_checkpoint
from services.inference.serve_config import ServeConfig
from tests.inference.harness import ServerThread, status_details
from tests.inference.test_overload import wait_until
from tests.inference.test_usage import ledger_rows

CONTEXT = 512  # the tiny checkpoint's max_position_embeddings: its full context
# llama_dir's shape: 2 layers, 2 KV heads of 16, float32; a block holds 16 tokens
BLOCK_BYTES = KVCache.bytes_per_block(2, 2, 16, 16, torch.float32)
POOL_BLOCKS = 48  # one and a half calls of the full context (32 blocks each); four slots could fill 128


def long_call(request_id: str, offset: int) -> pb.GenerateRequest:
    """400 prompt tokens and 100 new: 500 of the 512. Prompts of other offsets share no block: the second long
    call must not fit through the first one's cached prefix. Greedy, offset 0 runs all 100 on the tiny model."""
    prompt = [(7 * i + offset) % 300 + 1 for i in range(400)]
    return pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=100, temperature=0.0, request_id=request_id)


SHORT = pb.GenerateRequest(prompt_token_ids=list(range(1, 11)), max_tokens=6, temperature=0.0)
STEP_FLOOR_S = 0.03  # the long call runs about 3 s, the short ones about 0.2 s


def test_the_slots_are_kept_when_the_pool_holds_fewer_calls_of_the_full_context(llama_dir):
    checkpoint = load_checkpoint(str(llama_dir))
    memory = (POOL_BLOCKS + 1) * BLOCK_BYTES  # the scratch block is in the budget too
    executor = Executor(checkpoint, ExecutorConfig(max_batch=4, max_seq_len=CONTEXT, kv_memory_bytes=memory))
    assert (executor.num_slots, executor.max_seq_len, executor.num_blocks) == (4, CONTEXT, POOL_BLOCKS)
    with pytest.raises(ValueError, match="holds fewer than one call of max_seq_len 512 tokens"):
        Executor(checkpoint, ExecutorConfig(max_batch=4, max_seq_len=CONTEXT, kv_memory_bytes=20 * BLOCK_BYTES))


def blocks_used(server: ServerThread) -> float:
    return server.replica.metrics.registry.get_sample_value("zeroqueue_kv_blocks", {"state": "used"})


def in_flight(server: ServerThread, request_id: str) -> bool:
    return any(t.context.request_id == request_id for t in list(server.replica.service.in_flight.values()))


@pytest.mark.parametrize("admission", ["holding", "refusing", "fifo"])
def test_a_call_near_the_full_context_runs_while_short_calls_run_beside_it(llama_dir, admission):
    executor = ExecutorConfig(max_batch=4, max_seq_len=CONTEXT, kv_memory_bytes=(POOL_BLOCKS + 1) * BLOCK_BYTES)
    mode = "fifo" if admission == "fifo" else "deadline"
    config = ServeConfig(str(llama_dir), port=0, executor=executor, admission=mode, hold_blocks=admission == "holding")
    server = ServerThread(config, step_floor_s=STEP_FLOOR_S).start()
    try:
        stub = server.stub()
        (model,) = stub.ListModels(pb.ListModelsRequest(), timeout=5).models
        assert (model.context_length, model.max_batch, model.kv_blocks) == (CONTEXT, 4, POOL_BLOCKS)
        long_stream = stub.Generate(long_call("long-1", 0), timeout=60)
        assert next(long_stream).WhichOneof("kind") == "admission"
        # its prompt computed: the next steps' token budget is no longer taken by it (else STEP_BUDGET refusals)
        assert next(long_stream).WhichOneof("kind") == "chunk"
        with ThreadPoolExecutor(3) as pool:
            shorts = list(pool.map(lambda _: list(stub.Generate(SHORT, timeout=30)), range(3)))
        assert in_flight(server, "long-1"), "the short calls ran beside the long one, not after it"
        assert all(s[-1].final.usage.completion_tokens == 6 for s in shorts)
        second = long_call("long-2", 26)
        if admission == "holding":  # admitted at once, for the start long-1's blocks are planned to free at
            replies = list(stub.Generate(second, timeout=60))
            assert replies[0].admission.predicted_start_at_us > replies[0].admission.dispatched_at_us
            assert replies[-1].final.usage.prompt_tokens == 400 and replies[-1].final.timings.deadline_met
            assert server.replica.service.admission.events["held_for_blocks"] == 1
        elif admission == "refusing":
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(second, timeout=60))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            info = status_details(refused.value)["ErrorInfo"]
            assert info.metadata["cause"] == "kv_blocks" and "KV cache lacks the blocks" in refused.value.details()
            # the hint is the long call's predicted finish, inside the budget; its blocks are reserved from then
            assert 0 < int(info.metadata["retry_after_ms"]) < 60_000
            assert info.metadata["retry_reserved"] == "true" and "its KV blocks are reserved" in refused.value.details()
            assert in_flight(server, "long-1")
            sample = server.replica.metrics.registry.get_sample_value
            assert sample("zeroqueue_refusals_total", {"cause": "kv_blocks", "tenant": "acme"} | CLASS) == 1
            # a short call still fits beside the long one: the blocks it leaves free until its end
            assert list(stub.Generate(SHORT, timeout=30))[-1].final.usage.completion_tokens == 6
            time.sleep(int(info.metadata["retry_after_ms"]) / 1000)
            retry = list(stub.Generate(second, timeout=60, metadata=(("x-retry-attempt", "1"),)))
            assert retry[-1].final.usage.prompt_tokens == 400
            assert server.replica.service.admission.events["taken"] == 1
        else:  # FIFO queues it: the engine starts it once the first call's blocks are back
            assert list(stub.Generate(second, timeout=60))[-1].final.usage.prompt_tokens == 400
        assert list(long_stream)[-1].final.usage.completion_tokens == 100
        assert blocks_used(server) == 0
    finally:
        server.stop()


CLASS = {"service_class": "standard"}


@pytest.mark.parametrize("then", ["served", "cancelled"])
def test_a_long_call_held_for_blocks_that_free_late_starts_when_they_are_back(llama_dir, then):
    """The second long call is admitted at once for the start its blocks are planned to free at (no refusal: it
    is held for them, by default); the device then slows, the first call ends late, and the held call waits for
    its blocks past its planned start instead of starting without them. Both are served; or the waiting call is
    cancelled, and billed once as cancelled with no device time. The pool is empty of calls at the end."""
    executor = ExecutorConfig(max_batch=4, max_seq_len=CONTEXT, kv_memory_bytes=(POOL_BLOCKS + 1) * BLOCK_BYTES)
    config = ServeConfig(str(llama_dir), port=0, executor=executor, engine_process=False)
    server = ServerThread(config, step_floor_s=STEP_FLOOR_S).start()
    try:
        stub, service = server.stub(), server.replica.service
        long_stream = stub.Generate(long_call("long-1", 0), timeout=60)
        assert next(long_stream).WhichOneof("kind") == "admission"
        second = stub.Generate(long_call("long-2", 26), timeout=60)
        admission = next(second).admission
        assert admission.predicted_start_at_us > admission.dispatched_at_us  # held for long-1's blocks
        assert service.admission.events["held_for_blocks"] == 1
        assert blocks_used(server) == 32  # long-2's are not taken yet
        device = server.replica.engine.engine.executor.executor  # the slow executor, beneath the watchdog
        device.floor_s = 2 * STEP_FLOOR_S  # long-1 ends later than planned
        wait_until(lambda: service.awaiting_blocks, timeout=30)  # long-2's start came before its blocks
        assert in_flight(server, "long-1")
        if then == "cancelled":
            second.cancel()
            wait_until(lambda: not service.awaiting_blocks and not service.held)
        device.floor_s = STEP_FLOOR_S
        assert list(long_stream)[-1].final.usage.completion_tokens == 100
        if then == "served":
            final = list(second)[-1].final
            assert final.usage.prompt_tokens == 400 and final.timings.deadline_met
        wait_until(lambda: not service.in_flight)
        assert not service.awaiting_blocks and blocks_used(server) == 0
    finally:
        server.stop()
    rows = ledger_rows(server.config.ledger_url, "SELECT request_id, outcome, unit_us FROM usage_records")
    second_rows = [(r.outcome, r.unit_us > 0) for r in rows if r.request_id == "long-2"]
    assert second_rows == ([("ok", True)] if then == "served" else [("cancelled", False)])
    assert len(rows) == 2
