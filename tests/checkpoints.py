"""Tiny checkpoints built by the tests themselves, in the Hugging Face layout (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "The quick brown fox jumps over the lazy dog. Überraschung! 東京 🙂\n",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))\n",
]
EOS = "<|endoftext|>"


def build_tokenizer(vocab_size: int = 320) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return tokenizer


def save_hf_checkpoint(root: Path, kind: str = "llama", seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """A random transformers model saved with save_pretrained, plus our tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    eos_id = tokenizer.token_to_id(EOS)
    common = dict(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=eos_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model = model.to(getattr(torch, dtype)).eval()
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root)
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return root
