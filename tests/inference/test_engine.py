"""The engine end to end on a tiny model: batching, chunked prefill, stop strings, KV memory."""

from __future__ import annotations

import random
import time

import pytest
import torch

from services.inference.sched.request import RequestStatus
from tests.inference.conftest import Collector, make_engine, request, run_to_completion
from tests.inference.logits import prompt_logits

TEXTS = [
    "def add(a, b):",
    "class Point:\n    def",
    "for i in range(10):\n    print(",
    "import os\nimport",
    "The quick brown fox",
    "print(os.path.join(",
    "self.x = x\n        self.y",
    "return a",
]


@pytest.fixture
def engine(llama_dir):
    return make_engine(llama_dir, max_batch=8)


def prompts(engine):
    return [engine.tokenizer.encode(t * (1 + i % 3)).ids for i, t in enumerate(TEXTS)]


def run_alone(engine, prompt, **sampling):
    sink = Collector()
    engine.add_request(request("alone", prompt, **sampling), sink)
    run_to_completion(engine)
    return sink.tokens("alone")


def run_staggered(engine, all_prompts, **sampling):
    """Request i joins after i steps, so batches mix prefills and decodes of different lengths."""
    sink = Collector()
    for i, prompt in enumerate(all_prompts):
        engine.add_request(
            request(f"r{i}", prompt, **{k: v(i) if callable(v) else v for k, v in sampling.items()}), sink
        )
        engine.step()
    run_to_completion(engine)
    return [sink.tokens(f"r{i}") for i in range(len(all_prompts))]


def test_greedy_output_is_the_same_alone_and_in_a_batch(engine):
    all_prompts = prompts(engine)
    batched = run_staggered(engine, all_prompts, max_tokens=24)
    for i, prompt in enumerate(all_prompts):
        assert run_alone(engine, prompt, max_tokens=24) == batched[i], f"request {i} changed inside a batch"


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(engine):
    all_prompts = prompts(engine)
    params = dict(max_tokens=24, temperature=0.9, top_p=0.9, top_k=40)
    batched = run_staggered(engine, all_prompts, seed=lambda i: 1000 + i, **params)
    for i, prompt in enumerate(all_prompts):
        assert run_alone(engine, prompt, seed=1000 + i, **params) == batched[i]
    assert len({tuple(t) for t in batched}) > 1


def test_different_seeds_give_different_samples(engine):
    prompt = prompts(engine)[0]
    runs = {tuple(run_alone(engine, prompt, max_tokens=16, temperature=1.0, seed=s)) for s in range(4)}
    assert len(runs) > 1


def test_chunked_prefill_gives_the_same_logits_as_one_shot(engine):
    tokens = engine.tokenizer.encode(" ".join(TEXTS)).ids
    one_shot = prompt_logits(engine.executor, tokens)
    for chunk in (1, 7, 16):
        torch.testing.assert_close(
            prompt_logits(engine.executor, tokens, chunk_size=chunk, first_block=3), one_shot, atol=1e-5, rtol=1e-5
        )


def test_long_prompt_is_chunked_and_running_decodes_never_stall(llama_dir):
    engine = make_engine(llama_dir, max_batch=4, max_num_batched_tokens=16)
    sink = Collector()
    engine.add_request(request("short", [1, 2, 3], max_tokens=30), sink)
    engine.step()
    engine.add_request(request("long", list(range(5, 105)), max_tokens=2), sink)
    decoding_steps = 0
    while engine.has_work:
        report = engine.step()
        if report is None:
            continue
        assert report.scheduled.num_tokens <= 16
        if any(s.request.call_id == "long" for s in report.scheduled.prefills):
            assert any(s.request.call_id == "short" for s in report.scheduled.decodes) or sink.finish_reason("short")
            decoding_steps += 1
    assert decoding_steps >= 100 // 16
    assert len(sink.tokens("short")) == 30


def test_stop_string_is_never_emitted_even_in_part(engine):
    prompt = prompts(engine)[0]
    full = run_alone(engine, prompt, max_tokens=40)
    text = engine.tokenizer.decode(full)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop.strip()) >= 1
    sink = Collector()
    engine.add_request(request("s", prompt, max_tokens=40, stop=(stop,)), sink)
    run_to_completion(engine)
    streamed = sink.text("s")
    assert sink.finish_reason("s") == "stop"
    assert stop not in streamed
    answer = text[: text.index(stop)]
    assert streamed == answer
    cumulative = ""
    for out in sink.outputs["s"]:
        cumulative += out.text
        assert answer.startswith(cumulative), "a partial stop string reached the stream"


def test_stop_token_ends_the_request_without_being_streamed(engine):
    prompt = prompts(engine)[1]
    full = run_alone(engine, prompt, max_tokens=20)
    stop_token = full[5]
    sink = Collector()
    engine.add_request(request("t", prompt, max_tokens=20, stop_token_ids=frozenset({stop_token})), sink)
    run_to_completion(engine)
    assert sink.tokens("t") == full[: full.index(stop_token)]
    assert sink.finish_reason("t") == "stop"
    assert sink.outputs["t"][-1].num_output_tokens == full.index(stop_token) + 1


def test_outputs_carry_increasing_timestamps(engine):
    sink = Collector()
    before = time.monotonic_ns()
    engine.add_request(request("ts", prompts(engine)[0], max_tokens=8), sink)
    run_to_completion(engine)
    times = [o.time_ns for o in sink.outputs["ts"]]
    assert times == sorted(times) and times[0] >= before


def test_slots_and_kv_blocks_are_all_free_after_1000_requests_that_finish_cancel_or_expire(llama_dir):
    engine = make_engine(llama_dir, max_batch=6)
    rng = random.Random(7)
    sink = Collector()
    now = time.monotonic_ns()
    ended_while_running = {"cancelled": 0, "deadline_exceeded": 0}
    # shared prefixes of 0-3 full blocks under three salts (and none), so calls hit, miss and evict cached blocks
    prefixes = [[rng.randrange(1, 300) for _ in range(16 * n)] for n in range(4)]
    for i in range(1000):
        fate = rng.choice(["finish", "cancel", "expire"])
        deadline = now + 10**12 if fate != "expire" else time.monotonic_ns() + rng.randint(1, 4) * 2_000_000
        call = request(
            f"q{i}",
            rng.choice(prefixes) + [rng.randrange(1, 300) for _ in range(rng.randint(1, 12))],
            deadline_ns=deadline,
            max_tokens=rng.randint(1, 12),
        )
        call.cache_salt = rng.choice([None, b"a", b"b", b"c"])
        engine.add_request(call, sink)
        for _ in range(rng.randint(0, 3)):
            engine.step()
        if fate == "cancel":
            engine.cancel(f"q{i}")
        assert engine.scheduler.num_free_slots + len(engine.scheduler.running) == engine.executor.num_slots
    run_to_completion(engine)
    assert engine.scheduler.num_free_slots == engine.executor.num_slots
    pool = engine.scheduler.blocks
    assert pool.num_used == 0 and pool.num_free == engine.executor.num_blocks, "a KV block leaked"
    assert pool.num_hit_calls > 50 and pool.num_cached > 0  # the cache was exercised, not bypassed
    assert not engine.scheduler.requests and not engine._streams
    reasons = [sink.finish_reason(f"q{i}") for i in range(1000)]
    assert all(r in {"stop", "length", "cancelled", "deadline_exceeded"} for r in reasons)
    for i, reason in enumerate(reasons):
        if reason in ended_while_running and sink.tokens(f"q{i}"):
            ended_while_running[reason] += 1
    assert all(n > 0 for n in ended_while_running.values()), ended_while_running


def test_cancel_frees_the_slot_before_the_next_step(engine):
    sink = Collector()
    engine.add_request(request("c", prompts(engine)[0], max_tokens=50), sink)
    engine.step()
    engine.step()
    assert engine.scheduler.num_free_slots == engine.executor.num_slots - 1
    engine.cancel("c")
    engine.step()
    assert engine.scheduler.num_free_slots == engine.executor.num_slots
    assert sink.finish_reason("c") == "cancelled"


def test_expired_request_ends_with_deadline_exceeded(engine):
    sink = Collector()
    r = request("e", prompts(engine)[0], deadline_ns=time.monotonic_ns() + 10**12, max_tokens=50)
    engine.add_request(r, sink)
    engine.step()
    r.deadline_ns = time.monotonic_ns()
    engine.step()
    assert r.status == RequestStatus.FINISHED_EXPIRED
    assert sink.finish_reason("e") == "deadline_exceeded"
    assert engine.scheduler.num_free_slots == engine.executor.num_slots


def test_threaded_loop_streams_and_stops(engine):
    sink = Collector()
    engine.start()
    try:
        engine.add_request(request("bg", prompts(engine)[2], max_tokens=12), sink)
        deadline = time.monotonic() + 30
        while sink.finish_reason("bg") is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop()
    assert sink.finish_reason("bg") in {"length", "stop"}
    assert sink.outputs["bg"][-1].num_output_tokens >= 1


def test_a_call_whose_text_fails_ends_alone_and_the_step_goes_on(engine):
    sink = Collector()
    for rid in ("broken", "fine"):
        engine.add_request(request(rid, [5, 6, 7], max_tokens=8), sink)
    engine.step()  # both in, both prefilled

    def fail(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer that cannot decode")

    engine._streams["broken"].detokenizer.push = fail
    engine._streams["broken"].detokenizer.flush = fail
    run_to_completion(engine)
    assert sink.finish_reason("broken") == "error"
    assert sink.finish_reason("fine") == "length" and len(sink.tokens("fine")) == 8
    assert engine.scheduler.num_free_slots == engine.executor.num_slots
