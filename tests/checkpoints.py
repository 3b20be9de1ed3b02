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
# ChatML, the conventional multi-turn chat template (Qwen's, less its default system turn and tool calls): each turn is
# <|im_start|>{role}\n{content}<|im_end|>\n, and the generation prompt opens the assistant's turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


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


def build_chatml_tokenizer() -> Tokenizer:
    """build_tokenizer's, with ChatML's two markers added as special tokens (one id each, never split)."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens(list(CHATML_TOKENS))
    return tokenizer


def save_chatml_checkpoint(root: Path, template_file: bool = False, kind: str = "llama", **overrides) -> Path:
    """save_hf_checkpoint with build_chatml_tokenizer's tokenizer and CHATML_TEMPLATE: in tokenizer_config.json's
    `chat_template`, or with `template_file` in chat_template.jinja beside it (transformers reads either)."""
    config = {"eos_token": EOS}
    if not template_file:
        config["chat_template"] = CHATML_TEMPLATE
    root = save_hf_checkpoint(root, kind, tokenizer=build_chatml_tokenizer(), tokenizer_config=config, **overrides)
    if template_file:
        (root / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    return root


def save_hf_checkpoint(
    root: Path,
    kind: str = "llama",
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: Tokenizer | None = None,
    tokenizer_config: dict | None = None,
    **overrides,
) -> Path:
    """A random transformers model saved with save_pretrained, plus our tokenizer files (build_tokenizer's and
    {"eos_token": EOS} unless given)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = tokenizer or build_tokenizer()
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
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config or {"eos_token": EOS}))
    return root
