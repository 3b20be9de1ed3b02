"""Automatic prefix caching in the engine: a call whose prompt starts with blocks an earlier call of the same salt
computed skips their prefill, and gives token for token what it gives with the cache off, on plain torch and on
the CPU kernels, alone or beside calls that miss; salts keep tenants apart; every block comes back."""

from __future__ import annotations

import pytest
import torch

from tests.inference.conftest import Collector, make_engine, request, run_to_completion

BLOCK = 16


@pytest.fixture(params=[False, True], ids=["plain-torch", "kernels"])
def engine(request, llama_dir):
    return make_engine(llama_dir, max_batch=4, use_kernels=request.param, kv_block_size=BLOCK)


def shared_prompt(engine, tail: str) -> list[int]:
    head = "a system prompt that every call of this tenant starts with, " * 3
    return engine.tokenizer.encode(head + tail).ids


def run(engine, calls: dict[str, tuple[list[int], bytes | None]], max_tokens: int = 12):
    """Runs the calls together from one step on: (tokens per call id, the Request of each call)."""
    sink, requests = Collector(), {}
    for call_id, (prompt, salt) in calls.items():
        requests[call_id] = request(call_id, prompt, max_tokens=max_tokens, logprobs=True)
        requests[call_id].cache_salt = salt
        engine.add_request(requests[call_id], sink)
    run_to_completion(engine)
    return {c: sink.tokens(c) for c in calls}, requests, sink


def logprobs(sink: Collector, call_id: str) -> list[float]:
    return [lp[0] for o in sink.outputs[call_id] for lp in o.logprobs]  # (logprob, top alternatives)


def assert_pool_empty(engine) -> None:
    pool = engine.scheduler.blocks
    assert pool.num_used == 0 and pool.num_free == engine.executor.num_blocks


def test_a_cached_prefix_gives_the_same_tokens_and_logprobs_as_no_cache(engine):
    prompt = shared_prompt(engine, "and then its own question")
    cold, cold_req, cold_sink = run(engine, {"cold": (prompt, None)})
    first, first_req, _ = run(engine, {"first": (prompt, b"tenant-a")})
    again, again_req, again_sink = run(engine, {"again": (prompt, b"tenant-a")})
    assert cold_req["cold"].num_cached_tokens == 0 and first_req["first"].num_cached_tokens == 0
    hit = again_req["again"].num_cached_tokens
    assert hit == (len(prompt) - 1) // BLOCK * BLOCK and hit >= 2 * BLOCK
    assert again["again"] == first["first"] == cold["cold"]
    torch.testing.assert_close(logprobs(again_sink, "again"), logprobs(cold_sink, "cold"), atol=1e-4, rtol=0)
    assert_pool_empty(engine)


def test_hits_and_misses_in_one_step_each_match_their_call_alone(engine):
    prompts = {
        "hit": shared_prompt(engine, "then question one"),
        "miss": engine.tokenizer.encode("a prompt of its own that shares nothing at all with the others").ids,
        "other-tenant": shared_prompt(engine, "then question two"),
    }
    alone = {c: run(engine, {c: (p, None)})[0][c] for c, p in prompts.items()}
    run(engine, {"warm": (shared_prompt(engine, "warming the cache"), b"a")})
    salts = {"hit": b"a", "miss": b"a", "other-tenant": b"b"}
    together, reqs, _ = run(engine, {c: (p, salts[c]) for c, p in prompts.items()})
    assert reqs["hit"].num_cached_tokens > 0
    assert reqs["miss"].num_cached_tokens == 0
    assert reqs["other-tenant"].num_cached_tokens == 0, "tenant b read tenant a's blocks"
    assert together == alone
    assert_pool_empty(engine)


def test_a_salt_shared_on_purpose_shares_the_cache(llama_dir):
    engine = make_engine(llama_dir, max_batch=4, use_kernels=False, kv_block_size=BLOCK)
    prompt = shared_prompt(engine, "the same document, two tenants opted in")
    run(engine, {"a": (prompt, b"shared")})
    _, reqs, _ = run(engine, {"b": (prompt, b"shared")})
    assert reqs["b"].num_cached_tokens > 0


def test_a_call_without_a_salt_neither_reads_nor_fills_the_cache(llama_dir):
    engine = make_engine(llama_dir, max_batch=4, use_kernels=False, kv_block_size=BLOCK)
    prompt = shared_prompt(engine, "no salt")
    run(engine, {"a": (prompt, None)})
    assert engine.scheduler.blocks.num_cached == 0
    run(engine, {"b": (prompt, b"t")})
    _, reqs, _ = run(engine, {"c": (prompt, None)})
    assert reqs["c"].num_cached_tokens == 0 and engine.scheduler.blocks.num_cached > 0


def test_blocks_filled_by_generated_tokens_are_cached_too(llama_dir):
    # a chat's next turn sends the last answer back: its blocks are hits
    engine = make_engine(llama_dir, max_batch=4, use_kernels=False, kv_block_size=BLOCK)
    prompt = shared_prompt(engine, "turn one")
    out, _, _ = run(engine, {"turn1": (prompt, b"t")}, max_tokens=40)
    follow_up = prompt + out["turn1"] + engine.tokenizer.encode(" and turn two").ids
    _, reqs, _ = run(engine, {"turn2": (follow_up, b"t")})
    assert reqs["turn2"].num_cached_tokens > (len(prompt) // BLOCK) * BLOCK


def test_a_failed_step_gives_every_block_back(llama_dir):
    # after a step fails the engine ends every call ("error"): their blocks, shared prefixes too, all come back
    engine = make_engine(llama_dir, max_batch=4, use_kernels=False, kv_block_size=BLOCK)
    prompt = shared_prompt(engine, "before the fault")
    run(engine, {"warm": (prompt, b"t")})
    sink = Collector()
    for i in range(3):
        call = request(f"c{i}", prompt, max_tokens=30)
        call.cache_salt = b"t"
        engine.add_request(call, sink)
    engine.step()
    engine.step()
    assert engine.scheduler.blocks.num_used > 0
    engine.fail_all()
    assert {sink.finish_reason(f"c{i}") for i in range(3)} == {"error"}
    assert_pool_empty(engine)
