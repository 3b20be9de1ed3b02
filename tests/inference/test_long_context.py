"""Long contexts do not cap concurrency: a call holds the KV blocks of its own prompt and max_tokens, not a slot of
max_seq_len, so a replica started with the model's full context keeps its slots, and runs a call near that length
while short calls run beside it. Where the pool has fewer blocks than the slots could fill, admission counts them:
a second long call is refused for blocks (`kv_blocks`) with the running calls' predicted finish as its hint, and
FIFO admission starts it once the first one's blocks are back. The pool is empty of calls at the end."""

from __future__ import annotations

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


@pytest.mark.parametrize("admission", ["deadline", "fifo"])
def test_a_call_near_the_full_context_runs_while_short_calls_run_beside_it(llama_dir, admission):
    executor = ExecutorConfig(max_batch=4, max_seq_len=CONTEXT, kv_memory_bytes=(POOL_BLOCKS + 1) * BLOCK_BYTES)
    config = ServeConfig(str(llama_dir), port=0, executor=executor, admission=admission)
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
        if admission == "deadline":
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(second, timeout=60))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            info = status_details(refused.value)["ErrorInfo"]
            assert info.metadata["cause"] == "kv_blocks" and "KV cache lacks the blocks" in refused.value.details()
            # the hint is the long call's predicted finish: inside the budget, and not before the long call ends
            assert 0 < int(info.metadata["retry_after_ms"]) < 60_000
            assert in_flight(server, "long-1")
            sample = server.replica.metrics.registry.get_sample_value
            assert sample("zeroqueue_refusals_total", {"cause": "kv_blocks", "tenant": "acme"} | CLASS) == 1
        else:  # FIFO queues it: the engine starts it once the first call's blocks are back
            assert list(stub.Generate(second, timeout=60))[-1].final.usage.prompt_tokens == 400
        assert list(long_stream)[-1].final.usage.completion_tokens == 100
        assert blocks_used(server) == 0
    finally:
        server.stop()


CLASS = {"service_class": "standard"}
