"""Parity with Hugging Face transformers, a reference implementation nobody here wrote."""

from __future__ import annotations

import pytest
import torch

from services.inference.device.loader import load_checkpoint
from tests.checkpoints import save_hf_checkpoint
from tests.inference.conftest import Collector, make_engine, request, run_to_completion
from tests.inference.logits import prompt_logits

PROMPT = "def add(a, b):\n    return"


def hf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare full 32-token runs
    return model


def hf_logits(path, tokens):
    with torch.no_grad():
        return hf_model(path)(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(params=["llama", "qwen2"])
def checkpoint_dir(request, llama_dir, qwen_dir):
    return {"llama": llama_dir, "qwen2": qwen_dir}[request.param]


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "plain-torch"])  # plain torch: a GPU's code
def test_logits_match_transformers(checkpoint_dir, use_kernels):
    engine = make_engine(checkpoint_dir, use_kernels=use_kernels)
    assert (engine.executor.cpu_ops is not None) == use_kernels
    tokens = engine.tokenizer.encode(PROMPT).ids
    ours = prompt_logits(engine.executor, tokens)
    torch.testing.assert_close(ours, hf_logits(checkpoint_dir, tokens), atol=1e-4, rtol=0)


def test_qwen2_checkpoint_has_qkv_bias(qwen_dir):
    checkpoint = load_checkpoint(qwen_dir)
    assert checkpoint.args.attention_bias and not checkpoint.args.o_proj_bias
    assert "layers.0.self_attn.qkv_proj.bias" in checkpoint.state_dict


def greedy_beside_transformers(engine, path, max_tokens: int = 32) -> tuple[Collector, list[int]]:
    """The engine's greedy run of PROMPT (EOS ignored) as request "r", and transformers' generate on `path`."""
    engine.eos_token_ids = frozenset()
    tokens = engine.tokenizer.encode(PROMPT).ids
    sink = Collector()
    engine.add_request(request("r", tokens, max_tokens=max_tokens), sink)
    run_to_completion(engine)
    with torch.no_grad():
        reference = hf_model(path).generate(torch.tensor([tokens]), max_new_tokens=max_tokens, do_sample=False)
    return sink, reference[0, len(tokens) :].tolist()


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "plain-torch"])
def test_greedy_tokens_match_transformers_generate(checkpoint_dir, use_kernels):
    sink, reference = greedy_beside_transformers(make_engine(checkpoint_dir, use_kernels=use_kernels), checkpoint_dir)
    assert sink.tokens("r") == reference
    assert sink.finish_reason("r") == "length"


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 500000.0,
        },
    ],
)
def test_rope_scaling_matches_transformers(tmp_path, rope):
    path = save_hf_checkpoint(
        tmp_path, "llama", initializer_range=0.1, rope_scaling=rope, rope_theta=rope["rope_theta"]
    )
    engine = make_engine(path)
    assert engine.executor.model.args.rope_scaling.rope_type == rope["rope_type"]
    tokens = engine.tokenizer.encode(PROMPT * 4).ids  # longer than original_max_position_embeddings
    torch.testing.assert_close(prompt_logits(engine.executor, tokens), hf_logits(path, tokens), atol=1e-4, rtol=0)


def test_tied_embeddings_match_transformers(tmp_path):
    path = save_hf_checkpoint(tmp_path, "llama", initializer_range=0.1, tie_word_embeddings=True)
    engine = make_engine(path)
    tokens = engine.tokenizer.encode(PROMPT).ids
    torch.testing.assert_close(prompt_logits(engine.executor, tokens), hf_logits(path, tokens), atol=1e-4, rtol=0)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, llama_dir):
    model = hf_model(llama_dir)
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((llama_dir / name).read_bytes())
    assert (tmp_path / "model.safetensors.index.json").exists()
    single, sharded = load_checkpoint(llama_dir), load_checkpoint(tmp_path)
    assert single.state_dict.keys() == sharded.state_dict.keys()
    for key, value in single.state_dict.items():
        assert torch.equal(value, sharded.state_dict[key]), key


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_fp32(llama_dir, dtype):
    fp32 = make_engine(llama_dir)
    half = make_engine(llama_dir, dtype=dtype)
    assert half.executor.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    tokens = fp32.tokenizer.encode(PROMPT).ids
    reference = prompt_logits(fp32.executor, tokens)
    got = prompt_logits(half.executor, tokens)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference, atol=0.05, rtol=0.05)
