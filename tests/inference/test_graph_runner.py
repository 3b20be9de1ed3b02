"""The CUDA-graph path's padded static-buffer forward, run eagerly on CPU (capture=False): the part of
the graph path that CI can check. The capture itself is checked on a GPU by bench/gpu_check.py."""
from __future__ import annotations

import time

import torch

from services.inference.executor import GraphRunner
from tests.inference.conftest import Collector, make_engine, request, run_to_completion

PROMPTS = [[5, 6, 7], list(range(10, 30)), [40] * 9]


def static_runner(executor):
    return GraphRunner(executor.model, executor.backend, executor.num_slots, executor.max_seq_len,
                       executor.device, capture=False)


def test_padded_static_decode_matches_the_eager_step(llama_dir):
    engine = make_engine(llama_dir, max_batch=6)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(request(f"r{i}", prompt, max_tokens=20), Collector())
    engine.step()                                       # all three prompts in one step
    step = engine.scheduler.schedule(time.monotonic_ns())
    assert len(step.decodes) == 3 and not step.prefills
    free = [s for s in range(engine.executor.num_slots) if s not in {d.slot for d in step.decodes}]
    untouched = engine.executor.kv_cache.k[:, free].clone()
    with torch.inference_mode():
        eager = engine.executor._eager(step)
        runner = static_runner(engine.executor)
        padded, bucket = runner.replay(step.decodes)
    assert bucket == 4 and runner.buckets == [1, 2, 4, 6]
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(engine.executor.kv_cache.k[:, free], untouched), "padding wrote outside the scratch slot"


def test_engine_with_the_static_decode_path_generates_the_same_tokens(llama_dir):
    outputs = []
    for use_static in (False, True):
        engine = make_engine(llama_dir, max_batch=6)
        if use_static:
            engine.executor.graphs = static_runner(engine.executor)
        sink = Collector()
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(request(f"r{i}", prompt, max_tokens=24), sink)
        run_to_completion(engine)
        outputs.append([sink.tokens(f"r{i}") for i in range(len(PROMPTS))])
    assert outputs[0] == outputs[1]
