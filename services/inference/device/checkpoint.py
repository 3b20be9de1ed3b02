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
    quantization: str = "none"  # "int8": the layers' linear weights are stored int8 (int8_checkpoint.py)


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


# The one pre-quantized layout read: compressed-tensors' "int-quantized" format (what llm-compressor writes for W8A16),
# int8 weights with one scale per output channel, symmetric, activations not quantized; lm_head left out.
INT8_FORMAT = "int-quantized"


def quantization(config: dict[str, Any], path: Path) -> str:
    """ "none", or "int8" for a compressed-tensors W8A16 per-channel checkpoint; CheckpointError naming what else it
    is (GPTQ, AWQ, FP8, activation quantization ...), which this replica does not serve."""
    q = config.get("quantization_config")
    if q is None:
        return "none"
    method = q.get("quant_method") if isinstance(q, dict) else None
    groups = q.get("config_groups") if isinstance(q, dict) else None
    if method != "compressed-tensors" or q.get("format") != INT8_FORMAT or not isinstance(groups, dict):
        return _unsupported(path, f"quant_method {method!r}, format {q.get('format') if isinstance(q, dict) else q!r}")
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        wanted = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
        if not isinstance(weights, dict) or any(weights.get(k) != v for k, v in wanted.items()):
            return _unsupported(path, f"config group {name!r} is not int8 symmetric per channel ({weights!r})")
        if group.get("input_activations") is not None:
            return _unsupported(path, f"config group {name!r} quantizes activations")
    return "int8"


def _unsupported(path: Path, what: str) -> str:
    raise CheckpointError(
        path, f"quantization_config: {what}; only compressed-tensors {INT8_FORMAT} int8 weights per channel are read"
    )


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
        quantization=quantization(config, config_path),
    )
