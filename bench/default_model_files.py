"""bench/train_default_model.py's outputs: the checkpoint in the Hugging Face layout, its samples, its MODEL_CARD.md."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer

EOS = "<|endoftext|>"
EXCLUDED_DIRS = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "pydoc_data",
    "encodings",
    "turtledemo",
}
SAMPLE_PROMPTS = ("def ", "import os\n", "class ")
# the chat template is written by hand, not trained: it stays in the bundled directory, copied to any other --out
BUNDLED_DIR = Path(__file__).resolve().parents[1] / "services/inference/bundled/zq-python-tiny"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_SECTION = """## Chat template

`chat_template.jinja` (written by hand, not trained) renders a conversation as one Python file, since the model has
only ever read Python:

- system: the module's docstring;
- user: `# User: ` comment lines;
- tool: `# Tool (name): ` comment lines;
- assistant: its code after two blank lines (where the standard library starts a top-level `def` or `class`), then
  `<|endoftext|>`, the end-of-file token the model learnt between files: it ends an assistant's turn.

The generation prompt is those two blank lines, an opening for code: of 80 continuations sampled at temperature 0.8
(four one-line requests, with and without a system message), 56 began with `def` or `class` and 23 with a comment.
It is a demonstration of the chat path, not an assistant: whatever is asked, the answer is Python-shaped text.
"""


def save_checkpoint(model, tokenizer: Tokenizer, out: Path, seq_len: int) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    eos_id = tokenizer.token_to_id(EOS)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, bos_token_id=None, pad_token_id=eos_id)
    model.save_pretrained(out, safe_serialization=True)
    (out / "model.safetensors").chmod(0o644)  # save_pretrained leaves it owner-only; serving may be another user
    tokenizer.save(str(out / "tokenizer.json"))
    if out.resolve() != BUNDLED_DIR:
        shutil.copyfile(BUNDLED_DIR / CHAT_TEMPLATE_FILE, out / CHAT_TEMPLATE_FILE)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "model_max_length": seq_len,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n"
    )


@torch.no_grad()
def samples(model, tokenizer: Tokenizer, max_new_tokens: int = 48) -> list[dict]:
    """Greedy and temperature-0.8 continuations of SAMPLE_PROMPTS (seeded)."""
    model.eval()
    eos_id = tokenizer.token_to_id(EOS)
    out = []
    for i, prompt in enumerate(SAMPLE_PROMPTS):
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        for temperature in (0.0, 0.8):
            torch.manual_seed(i)
            kwargs = (
                {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {"do_sample": False}
            )
            gen = model.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=eos_id, **kwargs)
            out.append(
                {
                    "prompt": prompt,
                    "temperature": temperature,
                    "text": tokenizer.decode(gen[0, ids.shape[1] :].tolist(), skip_special_tokens=False),
                }
            )
    return out


def write_model_card(out: Path, report: dict) -> None:
    r, shape = report, report["shape"]
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    eos_md = EOS.replace("|", "\\|")  # a pipe ends a table cell even inside backticks
    lines = [
        "# zq-python-tiny",
        "",
        "The model `make serve` ships with: a small Llama-family model trained by zeroqueue from scratch on the "
        "Python standard library's own sources, so the service streams Python-like text on a machine with no "
        "network. It is a demonstration model, not a useful code assistant.",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | LlamaForCausalLM: hidden {shape['hidden']}, {shape['layers']} layers, "
        f"{shape['heads']} heads "
        f"({shape['kv_heads']} KV heads, head_dim {shape['head_dim']}), intermediate {shape['intermediate']}, "
        f"tied embeddings, rope_theta 10000, context {shape['seq_len']} |",
        f"| parameters | {r['num_parameters']:,} |",
        f"| weights | bfloat16, model.safetensors {size_mb:.1f} MB |",
        f"| corpus | {r['corpus']['train_files']} stdlib files of Python {r['python']} "
        f"({r['corpus']['train_tokens']:,} tokens); {r['corpus']['heldout_files']} files held out "
        f"({r['corpus']['heldout_tokens']:,} tokens); excluded dirs: "
        f"{', '.join(f'`{d}`' for d in sorted(EXCLUDED_DIRS))} |",
        f"| tokenizer | byte-level BPE (`tokenizers`), vocab {r['vocab_size']}, EOS `{eos_md}` between files |",
        f"| training | seed {r['seed']}, {r['steps_done']} steps"
        f"{' (cut short by --minutes; --stop-step repeats the cut)' if r['stopped_by_time_budget'] else ''}"
        f" x {shape['batch']} x {shape['seq_len']} tokens = "
        f"{r['tokens_seen']:,} tokens seen ({r['tokens_seen'] / r['corpus']['train_tokens']:.2f} epochs), "
        f"AdamW lr {r['lr']} warm-up {r['warmup']} + cosine, {r['train_time_s'] / 60:.1f} min on "
        f"{r['threads']} CPU threads at nice 10 on a shared machine, {r['tokens_seen'] / r['train_time_s']:,.0f} "
        f"tokens/s on average (torch {r['torch']}, {'bf16 autocast' if r['bf16_autocast'] else 'fp32'}) |",
        f"| final train loss | {r['final_train_loss']:.3f} nats/token (first {r['eval_tokens']:,} training tokens) |",
        f"| held-out loss | {r['heldout_loss']:.3f} nats/token, perplexity {math.exp(r['heldout_loss']):.1f} "
        f"(unigram baseline {r['unigram_heldout_loss']:.3f}, uniform ln(vocab) {math.log(r['vocab_size']):.3f}) |",
        "",
        "Reproduce (from the repository root):",
        "",
        "```",
        r["reproduce"],
        "```",
        "",
        "Samples (bf16 weights, transformers `generate`, 48 new tokens; temperature 0.8 is seeded):",
        "",
    ]
    for s in report["samples"]:
        lines += [
            f"prompt {s['prompt']!r}, temperature {s['temperature']}:",
            "",
            "```python",
            (s["prompt"] + s["text"]).replace("```", "` ` `"),
            "```",
            "",
        ]
    lines.append(CHAT_TEMPLATE_SECTION)
    (out / "MODEL_CARD.md").write_text("\n".join(lines))
