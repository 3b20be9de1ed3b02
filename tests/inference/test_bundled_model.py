"""The bundled default model (bench/train_default_model.py) loads with our loader and writes Python with our engine."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from services.inference.bundled_model import BUNDLED_MODEL
from services.inference.device.loader import load_checkpoint
from tests.inference.conftest import Collector, make_engine, request, run_to_completion
from tests.inference.logits import prompt_logits

MAX_FILE_BYTES = 25_000_000
# Written for this test, not taken from the standard library the model was trained on.
SNIPPET = '''import os
import sys


def count_lines(path):
    """Return the number of lines in the file at path."""
    total = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                total += 1
    return total


class Inventory:
    def __init__(self, items=None):
        self.items = dict(items or {})

    def add(self, name, count=1):
        if count < 0:
            raise ValueError("count must not be negative")
        self.items[name] = self.items.get(name, 0) + count
        return self.items[name]
'''


@pytest.fixture(scope="module")
def engine():
    return make_engine(BUNDLED_MODEL, dtype="bfloat16")


def mean_loss(engine, tokens: list[int]) -> float:
    logits = prompt_logits(engine.executor, tokens).float()  # [T, vocab]
    return float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(tokens[1:])))


def test_files_are_the_hugging_face_layout_within_budget():
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "MODEL_CARD.md",
        "training_log.json",
    ):
        assert (BUNDLED_MODEL / name).is_file(), name
    for f in BUNDLED_MODEL.iterdir():
        assert f.stat().st_size <= MAX_FILE_BYTES, f"{f.name} is {f.stat().st_size} bytes"
    assert json.loads((BUNDLED_MODEL / "config.json").read_text())["dtype"] == "bfloat16"


def test_loads_in_bf16_with_eos_from_the_tokenizer():
    checkpoint = load_checkpoint(BUNDLED_MODEL)  # dtype "auto" reads config.json
    assert checkpoint.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in checkpoint.state_dict.values())
    assert checkpoint.eos_token_ids == (checkpoint.tokenizer.token_to_id("<|endoftext|>"),)
    assert checkpoint.args.vocab_size == checkpoint.tokenizer.get_vocab_size()


def test_greedy_generation_streams_text_that_decodes_cleanly(engine):
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode("import os\n\n\ndef ").ids
    sink = Collector()
    engine.add_request(request("bundled", prompt, max_tokens=32), sink)
    run_to_completion(engine)
    tokens, text = sink.tokens("bundled"), sink.text("bundled")
    finish = sink.finish_reason("bundled")
    assert (finish == "length" and len(tokens) == 32) or (finish == "stop" and len(tokens) < 32)
    assert text.strip()
    assert "\ufffd" not in text
    assert text == tokenizer.decode(tokens)


def test_loss_on_unseen_python_is_far_below_uniform(engine):
    tokens = engine.tokenizer.encode(SNIPPET).ids
    assert 100 < len(tokens) < engine.executor.max_seq_len
    uniform = math.log(engine.tokenizer.get_vocab_size())
    loss = mean_loss(engine, tokens)
    assert loss < 0.6 * uniform, (loss, uniform)
    # The same tokens in a random order: the model must be using the order, not just token frequencies.
    shuffled = tokens[:]
    random.Random(0).shuffle(shuffled)
    assert mean_loss(engine, shuffled) > loss + 1.0
