"""The prefix cache through a replica: a tenant's second call with the same long prompt is served from its first
call's blocks and says so in its reply, its usage record and the metrics; another tenant's call is not (the
cache is a timing side channel), unless the operator shared a cache between them; --no-prefix-cache turns it off.
Each call's tokens are the same whether it hit or not."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs
from zeroqueue.inference.v1 import inference_pb2 as pb

from billing import commands
from services.inference.device.executor import ExecutorConfig
from services.inference.policy import PrefixCachePolicy
from services.inference.serve_config import ServeConfig
from tests.inference.harness import ServerThread
from tests.inference.test_overload import wait_until
from tests.inference.test_usage import ledger_rows

PROMPT = "def handler(event, context):\n    body = event['body']\n    return process(body)\n" * 3


def start(llama_dir, prefix_cache: PrefixCachePolicy, admission: str = "deadline") -> ServerThread:
    executor = ExecutorConfig(max_batch=4, max_seq_len=256)
    config = ServeConfig(str(llama_dir), port=0, executor=executor, prefix_cache=prefix_cache, admission=admission)
    server = ServerThread(config).start()
    server.beta_key = commands.create_tenant(server.config.ledger_url, "beta")
    return server


def call(server: ServerThread, key: str, request_id: str) -> tuple[list[int], pb.Final]:
    request = pb.GenerateRequest(prompt=PROMPT, max_tokens=8, temperature=0.0, request_id=request_id)
    replies = list(server.stub(key=key).Generate(request, timeout=60))
    tokens = [t for r in replies if r.WhichOneof("kind") == "chunk" for t in r.chunk.token_ids]
    return tokens, replies[-1].final


def cached_in_ledger(server: ServerThread) -> dict[str, int]:
    rows = ledger_rows(server.config.ledger_url, "SELECT request_id, cached_prompt_tokens FROM usage_records")
    return {row.request_id: row.cached_prompt_tokens for row in rows}


def hit_tokens(server: ServerThread) -> float:
    sample = server.replica.metrics.registry.get_sample_value
    return sample("zeroqueue_prefix_cache_prompt_tokens_total", {"result": "hit"}) or 0


@pytest.mark.parametrize(
    "shared,admission",
    [(False, "deadline"), (True, "deadline"), (False, "fifo")],
    ids=["per-tenant", "shared", "fifo"],  # deadline admission reserves the blocks; FIFO leaves them to the engine
)
def test_a_tenants_second_call_is_served_from_its_first_calls_blocks(llama_dir, shared, admission):
    policy = PrefixCachePolicy(shared=frozenset({"acme", "beta"}) if shared else frozenset())
    server = start(llama_dir, policy, admission)
    try:
        # deadline admission's engine starts waiting calls by deadline, FIFO's in arrival order (a plain queue)
        assert server.replica.engine.spec.earliest_deadline_first == (admission == "deadline")
        with capture_logs() as logs:
            first, first_final = call(server, server.key, "a1")
            again, again_final = call(server, server.key, "a2")
            other, other_final = call(server, server.beta_key, "b1")
            wait_until(lambda: sum(e["event"] == "request_done" for e in logs) == 3)
        logged = {e["request_id"]: e["cached_prompt_tokens"] for e in logs if e["event"] == "request_done"}
        prompt_tokens = again_final.usage.prompt_tokens
        assert first_final.usage.cached_prompt_tokens == 0
        assert again_final.usage.cached_prompt_tokens == (prompt_tokens - 1) // 16 * 16 > 0
        # tenant beta reads acme's blocks only when the operator shared one cache between them
        assert other_final.usage.cached_prompt_tokens == (again_final.usage.cached_prompt_tokens if shared else 0)
        assert first == again == other
        assert logged == {
            r: f.usage.cached_prompt_tokens for r, f in (("a1", first_final), ("a2", again_final), ("b1", other_final))
        }
        assert hit_tokens(server) == again_final.usage.cached_prompt_tokens * (2 if shared else 1)
    finally:
        server.stop()  # the outbox drains into the ledger
    expected = {"a1": 0, "a2": again_final.usage.cached_prompt_tokens, "b1": other_final.usage.cached_prompt_tokens}
    assert cached_in_ledger(server) == expected


def test_no_prefix_cache_prefills_every_prompt(llama_dir):
    server = start(llama_dir, PrefixCachePolicy(enabled=False))
    try:
        (model,) = server.stub().ListModels(pb.ListModelsRequest(), timeout=5).models
        assert not model.prefix_cache
        _, first = call(server, server.key, "a1")
        _, again = call(server, server.key, "a2")
        assert first.usage.cached_prompt_tokens == again.usage.cached_prompt_tokens == 0
        assert hit_tokens(server) == 0
    finally:
        server.stop()
