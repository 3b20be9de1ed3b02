"""Writes a `zeroqueue pulse --request-file` (JSON Lines) whose calls share one long prompt prefix: a document
(the start of a source file of this repository, about --prefix-tokens tokens of the bundled tokenizer), then a
question of their own, as a RAG service asks several questions about one document. stdout is the file.

    python bench/shared_prefix_calls.py --prefix-tokens 1000 > calls.jsonl
    zeroqueue pulse --request-file calls.jsonl --model bench/out/smollm2-135m-shape ...   (BENCHMARKS.md)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenizers import Tokenizer  # noqa: E402

from services.inference.bundled_model import BUNDLED_MODEL  # noqa: E402

DOCUMENT = ROOT / "services" / "inference" / "sched" / "blocks.py"
QUESTIONS = (
    "What does allocate return when the pool is full?",
    "Which blocks are evicted first?",
    "Why is the key a SHA-256 and not hash()?",
    "What happens to a block freed twice?",
    "How does a salt isolate tenants?",
    "When is a block registered under its key?",
    "What does num_free count?",
    "Why is the last prompt token never reused?",
)


def document(num_tokens: int) -> str:
    """The document's leading text that the bundled tokenizer reads as about `num_tokens` tokens."""
    text = DOCUMENT.read_text()
    encoding = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json")).encode(text)
    if num_tokens >= len(encoding.ids):
        return text
    return text[: encoding.offsets[num_tokens][0]]


def request_lines(prefix: str, max_tokens: int) -> list[str]:
    """The request file's lines: the shared prefix, then each question."""
    return [json.dumps({"prompt": f"{prefix}\n# Q: {q}\n# A:", "max_tokens": max_tokens}) for q in QUESTIONS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    print("\n".join(request_lines(document(args.prefix_tokens), args.max_tokens)))


if __name__ == "__main__":
    main()
