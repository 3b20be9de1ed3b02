"""A checkpoint's header: what a Hugging Face checkpoint directory says about its model, read without torch and
without its weights (config.json, tokenizer.json, the generation and tokenizer configs). The server process serves
from the header alone; the engine process reads the header and then the weights (loader.py's Checkpoint).

Every problem with the directory is one `CheckpointError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from .config import ConfigError, ModelArgs

# the dtype names a replica takes (--dtype, or config.json's torch_dtype) -> the one name for each dtype
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


class CheckpointError(Exception):
    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


@dataclass(frozen=True)
class CheckpointHeader:
    path: Path
    name: str
    args: ModelArgs
    dtype: str  # float32 | bfloat16 | float16: what the weights are served in
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CheckpointError(path, "file is missing")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, "expected a JSON object")
    return data


def dtype_name(name: str, config: dict[str, Any]) -> str:
    """The dtype to serve in: the one asked for, or with "auto" the checkpoint's own (float32 if it names none)."""
    if name == "auto":
        name = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    if name not in DTYPE_NAMES:
        raise CheckpointError("dtype", f"unsupported dtype {name!r}; use one of float32, bfloat16, float16")
    return DTYPE_NAMES[name]


def _eos_ids(root: Path, config: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
    for source in (read_json(root / "generation_config.json", required=False), config):
        eos = source.get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    token = read_json(root / "tokenizer_config.json", required=False).get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
    return (token_id,) if token_id is not None else ()


def read_header(path: str | Path, dtype: str = "auto") -> CheckpointHeader:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(root, "is not a directory")
    config_path = root / "config.json"
    config = read_json(config_path)
    try:
        args = ModelArgs.from_hf(config)
    except ConfigError as exc:
        raise CheckpointError(config_path, str(exc)) from None
    tokenizer_path = root / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise CheckpointError(tokenizer_path, "file is missing")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as exc:  # tokenizers raises a bare Exception for every parse failure
        raise CheckpointError(tokenizer_path, f"cannot parse tokenizer ({exc})") from None
    return CheckpointHeader(
        path=root,
        name=root.name,
        args=args,
        dtype=dtype_name(dtype, config),
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(root, config, tokenizer),
    )
