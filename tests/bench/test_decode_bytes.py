"""bench/decode.py's count of the bytes a quantized decode step reads, which its bandwidth shares divide by: the
int8 LM head and int8 or int4 layer linears with their scales, the norms as they are, the embedding left out."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]


def load_decode_bench():
    spec = importlib.util.spec_from_file_location("decode_bench", ROOT / "bench" / "decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quantized_bytes_count_int8_and_int4_layers_and_an_int8_head():
    decode = load_decode_bench()
    checkpoint = SimpleNamespace(
        state_dict={
            "embed_tokens.weight": torch.zeros(100, 64, dtype=torch.bfloat16),  # a lookup: left out
            "lm_head.weight": torch.zeros(100, 64, dtype=torch.bfloat16),  # int8 either way: 6400 + 4 * 100
            "layers.0.self_attn.qkv_proj.weight": torch.zeros(96, 130, dtype=torch.bfloat16),
            "layers.0.input_layernorm.weight": torch.zeros(64, dtype=torch.bfloat16),  # 128 bytes as it is
        }
    )
    head, norm = 6400 + 400, 128
    assert decode.quantized_weight_bytes(checkpoint, "int8") == head + norm + 96 * 130 + 4 * 96
    # int4: half a byte a weight, a fp32 scale per column and group of 64 inputs (130 inputs: 3 groups)
    assert decode.quantized_weight_bytes(checkpoint, "int4") == head + norm + 96 * 130 // 2 + 4 * 96 * 3
