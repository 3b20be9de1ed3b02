"""Every step's layers in one op (zeroqueue::decode_layers): a decode-only step bit-identical to the
layer-by-layer path, a prompt (each row attending over its blocks of the cache from its own position) equal to it
within rounding and bit-identical however it is chunked, and greedy tokens equal to transformers'.

The shared test checkpoints have head_dim 16, which the decode-attention kernel is not built for (so they run
layer by layer); these use head_dim 32."""

from __future__ import annotations

import time

import pytest
import torch

from services.inference.device import kernels
from services.inference.device.model import DecoderStack
from services.inference.device.packed import KernelDecoderStack
from tests.checkpoints import save_hf_checkpoint
from tests.inference.conftest import Collector, make_engine, request, run_to_completion
from tests.inference.logits import prompt_logits
from tests.inference.test_parity import PROMPT, greedy_beside_transformers, hf_logits, hf_model

pytestmark = pytest.mark.skipif(kernels.load_cpu_ops() is None, reason=f"{kernels.reason_unavailable()}")

PROMPTS = [[5, 6, 7], list(range(10, 40)), [40] * 9, [7, 8]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def wide_heads_dir(request, tmp_path_factory):
    """hidden 128, 4 heads of 32, 2 KV heads; the Qwen2 one has q/k/v biases. The norms get weights of their
    own (transformers starts them at ones), so a kernel that read the wrong norm's weights would show."""
    path = save_hf_checkpoint(
        tmp_path_factory.mktemp(request.param),
        request.param,
        initializer_range=0.1,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
    )
    model = hf_model(path)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.copy_(1 + 0.2 * torch.randn(weight.shape, generator=generator))
    model.save_pretrained(path)
    return path


class CountingOps:
    """The executor's CpuOps with decode_layers calls counted."""

    def __init__(self, ops: kernels.CpuOps) -> None:
        self.ops, self.calls = ops, 0

    def decode_layers(self, *args, **kwargs):
        self.calls += 1
        return self.ops.decode_layers(*args, **kwargs)


def count_fused_calls(engine) -> CountingOps:
    stack = engine.executor.model.layers
    assert isinstance(stack, KernelDecoderStack)
    stack.ops = CountingOps(stack.ops)
    return stack.ops


def decode_step_after_prompts(engine):
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(request(f"r{i}", prompt, max_tokens=20), Collector())
    engine.step()  # every prompt in one step
    engine.step()  # and a first decode, so lengths differ by row
    step = engine.scheduler.schedule(time.monotonic_ns())
    assert len(step.decodes) == len(PROMPTS) and not step.prefills
    return step


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layers_are_bit_identical_to_the_layer_by_layer_path(wide_heads_dir, dtype):
    engine = make_engine(wide_heads_dir, dtype=dtype, max_batch=6)
    step = decode_step_after_prompts(engine)
    executor, cache = engine.executor, engine.executor.kv_cache
    before_k, before_v = cache.k.clone(), cache.v.clone()
    model, calls = executor.model, count_fused_calls(engine)
    with torch.inference_mode():
        fused = executor._eager(step)
        fused_k, fused_v = cache.k.clone(), cache.v.clone()
        cache.k.copy_(before_k)
        cache.v.copy_(before_v)
        model.layers.forward = lambda *a: DecoderStack.forward(model.layers, *a)  # layer by layer
        layered = executor._eager(step)
    assert calls.calls == 1
    assert torch.equal(fused, layered)
    assert torch.equal(fused_k, cache.k) and torch.equal(fused_v, cache.v)
    assert not torch.equal(fused_k, before_k), "the step wrote no k into the cache"


def test_engine_takes_the_fused_path_for_every_step(wide_heads_dir):
    engine = make_engine(wide_heads_dir, dtype="bfloat16", max_batch=4)
    calls = count_fused_calls(engine)
    sinks = Collector()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(request(f"r{i}", prompt, max_tokens=12, ignore_eos=True), sinks)
    steps = run_to_completion(engine)
    assert calls.calls == steps
    assert all(len(sinks.tokens(f"r{i}")) == 12 for i in range(len(PROMPTS)))


def test_a_prompt_on_the_fused_path_matches_the_layer_by_layer_path(wide_heads_dir):
    """Two attention kernels, two roundings: in fp32 as close as fp32 allows; in bf16 the fused path is no
    farther from the fp32 logits than the layer-by-layer path is (mean and worst error, with 25 % to spare)."""
    logits = {}
    for dtype in ("float32", "bfloat16"):
        engine = make_engine(wide_heads_dir, dtype=dtype, max_batch=4)
        tokens = engine.tokenizer.encode(PROMPT * 3).ids
        logits[dtype, "fused"] = prompt_logits(engine.executor, tokens)
        layers = engine.executor.model.layers
        layers.forward = lambda *a, layers=layers: DecoderStack.forward(layers, *a)  # attention by SDPA
        logits[dtype, "layers"] = prompt_logits(engine.executor, tokens)
    torch.testing.assert_close(logits["float32", "fused"], logits["float32", "layers"], atol=1e-5, rtol=0)
    error = {path: (logits["bfloat16", path] - logits["float32", "layers"]).abs() for path in ("fused", "layers")}
    assert error["fused"].mean() <= 1.25 * error["layers"].mean()
    assert error["fused"].max() <= 1.25 * error["layers"].max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_chunked_prompt_is_bit_identical_to_one_shot_on_the_fused_path(wide_heads_dir, dtype):
    engine = make_engine(wide_heads_dir, dtype=dtype, max_batch=4)
    tokens = engine.tokenizer.encode(PROMPT * 3).ids
    one_shot = prompt_logits(engine.executor, tokens)
    for chunk in (1, 7, 16):
        assert torch.equal(prompt_logits(engine.executor, tokens, chunk_size=chunk, first_block=5), one_shot), chunk


def test_prompt_logits_on_the_fused_path_match_transformers(wide_heads_dir):
    engine = make_engine(wide_heads_dir)
    calls = count_fused_calls(engine)
    tokens = engine.tokenizer.encode(PROMPT).ids
    torch.testing.assert_close(
        prompt_logits(engine.executor, tokens), hf_logits(wide_heads_dir, tokens), atol=1e-4, rtol=0
    )
    assert calls.calls == 1


def test_greedy_tokens_match_transformers_generate_on_the_fused_path(wide_heads_dir):
    engine = make_engine(wide_heads_dir)
    calls = count_fused_calls(engine)
    sink, reference = greedy_beside_transformers(engine, wide_heads_dir)
    assert calls.calls == 32  # the prompt step and 31 decode steps
    assert sink.tokens("r") == reference


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_call_decodes_the_same_alone_and_among_calls_joining_mid_stream(wide_heads_dir, dtype):
    """Steps that mix decodes with other calls' prompt chunks (max_num_batched_tokens 40 chunks the long
    prompts) still give a call the tokens it gets alone, greedy and seeded."""

    def tokens_of_the_call(sampling: dict, num_neighbours: int) -> list[int]:
        engine = make_engine(wide_heads_dir, dtype=dtype, max_batch=8, max_num_batched_tokens=40)
        sink = Collector()
        engine.add_request(request("t", PROMPTS[1], max_tokens=16, ignore_eos=True, **sampling), sink)
        for i in range(num_neighbours):  # a neighbour joins every other step
            engine.step()
            engine.step()
            engine.add_request(request(f"n{i}", list(range(50 + i, 50 + 9 * (i + 2))), max_tokens=8), Collector())
        run_to_completion(engine)
        return sink.tokens("t")

    for name, sampling in (("greedy", {}), ("seeded", dict(temperature=0.9, seed=7))):
        assert tokens_of_the_call(sampling, 6) == tokens_of_the_call(sampling, 0), name


def test_decode_layers_names_a_wrong_weight_count(wide_heads_dir):
    engine = make_engine(wide_heads_dir, max_batch=4)
    stack, cache = engine.executor.model.layers, engine.executor.kv_cache
    x = torch.zeros(1, 128)
    ints = torch.zeros(1, dtype=torch.int64)
    rotary = engine.executor.model.rotary
    with pytest.raises(RuntimeError, match="expected 6 weights for each of 3 layers, got 17"):
        stack.ops.decode_layers(
            x,
            stack.weights[:-1],
            stack.biases,
            stack.scales,
            stack.out_features,
            rotary.cos,
            rotary.sin,
            ints,
            ints,
            ints[:, None],
            ints + 1,
            cache.k,
            cache.v,
            stack.heads,
            stack.kv_heads,
            stack.eps,
            stack.scale,
        )
