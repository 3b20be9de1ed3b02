"""The CUDA-graph path's padded static-buffer forward, run eagerly on CPU (capture=False): the part of the
graph path that CI can check. The capture itself is checked on a GPU by bench/gpu_check.py. Each test runs
on plain torch (the code a GPU runs) and with the CPU kernels."""

from __future__ import annotations

import time

import pytest
import torch

from services.inference.device.cuda_graphs import Bucket, GraphRunner, context_buckets
from tests.inference.conftest import Collector, make_engine, request

PROMPTS = [[5, 6, 7], list(range(10, 30)), [40] * 9]


@pytest.fixture(params=[False, True], ids=["plain-torch", "kernels"])
def use_kernels(request):
    return request.param


def static_runner(executor):
    return GraphRunner(
        executor.model, executor.backend, executor.num_slots, executor.max_seq_len, executor.device, capture=False
    )


def decode_step(engine, prompts):
    for i, prompt in enumerate(prompts):
        engine.add_request(request(f"r{i}", prompt, max_tokens=20), Collector())
    engine.step()  # every prompt in one step
    step = engine.scheduler.schedule(time.monotonic_ns())
    assert len(step.decodes) == len(prompts) and not step.prefills
    return step


def test_padded_static_decode_matches_the_eager_step(llama_dir, use_kernels):
    engine = make_engine(llama_dir, max_batch=6, use_kernels=use_kernels)
    assert (engine.executor.cpu_ops is not None) == use_kernels
    step = decode_step(engine, PROMPTS)
    used = {b for d in step.decodes for b in d.block_ids}
    free = [b for b in range(engine.executor.num_blocks) if b not in used]
    untouched = engine.executor.kv_cache.k[:, free].clone()
    with torch.inference_mode():
        eager = engine.executor._eager(step)
        runner = static_runner(engine.executor)
        padded, bucket = runner.replay(step.decodes)
    assert bucket == Bucket(4, 128) and runner.buckets == [1, 2, 4, 6] and runner.context_buckets == [128, 256]
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(engine.executor.kv_cache.k[:, free], untouched), "padding wrote outside the scratch block"


def test_context_buckets_double_up_to_the_configured_context():
    assert context_buckets(128) == [128]
    assert context_buckets(200) == [128, 200]
    assert context_buckets(1024) == [128, 256, 512, 1024]


def test_a_replay_reads_the_cache_only_as_far_as_its_longest_row(llama_dir, use_kernels):
    # a row at position 150 needs the 256 bucket; without it attention would stop at 128 and differ
    engine = make_engine(llama_dir, max_batch=4, use_kernels=use_kernels, max_num_batched_tokens=512)
    step = decode_step(engine, [[7] * 150, [8, 9]])
    runner = static_runner(engine.executor)
    with torch.inference_mode():
        eager = engine.executor._eager(step)
        padded, bucket = runner.replay(step.decodes)
        short = runner.forward_static(Bucket(2, 128))  # the same buffers, read only to position 128
    assert bucket == Bucket(2, 256)
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(short[1], eager[1], atol=1e-5, rtol=1e-5)  # the short row fits in 128
    assert not torch.allclose(short[0], eager[0], atol=1e-3)


def generate(engine, prompts, max_tokens):
    """(tokens per call, the sink, how many calls finished while another call's prompt was still prefilling)."""
    sink, finished_in_prefill = Collector(), 0
    for i, prompt in enumerate(prompts):
        engine.add_request(request(f"r{i}", prompt, max_tokens=max_tokens[i]), sink)
    while engine.has_work:
        report = engine.step()
        prefilling = any(r.is_prefilling for r in (*engine.scheduler.running, *engine.scheduler.waiting))
        finished_in_prefill += len(report.ended) if report is not None and prefilling else 0
    return [sink.tokens(f"r{i}") for i in range(len(prompts))], sink, finished_in_prefill


@pytest.mark.parametrize("budget", [256, 16], ids=["one-step-prefill", "chunked-prefill"])
def test_engine_with_the_static_decode_path_generates_the_same_tokens(llama_dir, use_kernels, budget):
    # with a 16-token budget the prompts are chunked, and the 2-token calls finish while others still prefill
    prompts = [*PROMPTS, list(range(50, 90)), [3] * 5]
    max_tokens = [24, 2, 24, 30, 2]
    outputs = []
    for use_static in (False, True):
        engine = make_engine(llama_dir, max_batch=6, use_kernels=use_kernels, max_num_batched_tokens=budget)
        if use_static:
            engine.executor.graphs = static_runner(engine.executor)
        tokens, sink, finished_in_prefill = generate(engine, prompts, max_tokens)
        assert [len(t) for t in tokens] == max_tokens
        assert (finished_in_prefill > 0) == (budget == 16)
        assert all(sink.finish_reason(f"r{i}") == "length" for i in range(len(prompts)))
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
