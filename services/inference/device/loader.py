"""Reads a local Hugging Face checkpoint directory into our parameter layout.

Every problem with the directory is one `CheckpointError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from .config import ConfigError, ModelArgs

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {  # our fused parameter -> the Hugging Face parameters concatenated into it, in order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_PLAIN = ("self_attn.o_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")


class CheckpointError(Exception):
    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    name: str
    args: ModelArgs
    dtype: torch.dtype
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


def _read_json(path: Path, required: bool = True) -> dict[str, Any]:
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


def _weight_files(root: Path) -> list[Path]:
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    index_path = root / "model.safetensors.index.json"
    if not index_path.is_file():
        raise CheckpointError(root / "model.safetensors", "file is missing (and no model.safetensors.index.json)")
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(index_path, "has no weight_map")
    files = [root / name for name in sorted(set(weight_map.values()))]
    for f in files:
        if not f.is_file():
            raise CheckpointError(f, "shard named in model.safetensors.index.json is missing")
    return files


def _read_tensors(files: list[Path]) -> dict[str, tuple[torch.Tensor, Path]]:
    tensors: dict[str, tuple[torch.Tensor, Path]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():
                    if not _IGNORED.match(key):
                        tensors[key] = (handle.get_tensor(key), f)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f, f"cannot read safetensors file ({exc})") from None
    return tensors


def _expected_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (a.vocab_size, a.hidden_size), "model.norm.weight": (a.hidden_size,)}
    if not a.tie_word_embeddings:
        shapes["lm_head.weight"] = (a.vocab_size, a.hidden_size)
    per_layer = {
        "self_attn.q_proj.weight": (a.q_size, a.hidden_size),
        "self_attn.k_proj.weight": (a.kv_size, a.hidden_size),
        "self_attn.v_proj.weight": (a.kv_size, a.hidden_size),
        "self_attn.o_proj.weight": (a.hidden_size, a.q_size),
        "mlp.gate_proj.weight": (a.intermediate_size, a.hidden_size),
        "mlp.up_proj.weight": (a.intermediate_size, a.hidden_size),
        "mlp.down_proj.weight": (a.hidden_size, a.intermediate_size),
        "input_layernorm.weight": (a.hidden_size,),
        "post_attention_layernorm.weight": (a.hidden_size,),
    }
    if a.attention_bias:
        per_layer.update(
            {
                "self_attn.q_proj.bias": (a.q_size,),
                "self_attn.k_proj.bias": (a.kv_size,),
                "self_attn.v_proj.bias": (a.kv_size,),
            }
        )
    if a.o_proj_bias:
        per_layer["self_attn.o_proj.bias"] = (a.hidden_size,)
    if a.mlp_bias:
        per_layer.update(
            {
                "mlp.gate_proj.bias": (a.intermediate_size,),
                "mlp.up_proj.bias": (a.intermediate_size,),
                "mlp.down_proj.bias": (a.hidden_size,),
            }
        )
    for i in range(a.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def _check(tensors: dict[str, tuple[torch.Tensor, Path]], args: ModelArgs, root: Path) -> None:
    expected = _expected_shapes(args)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(root, f"missing tensors: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    extra = sorted(set(tensors) - set(expected) - ({"lm_head.weight"} if args.tie_word_embeddings else set()))
    if extra:
        raise CheckpointError(tensors[extra[0]][1], f"unexpected tensors for {args.model_type}: {', '.join(extra[:5])}")
    for name, shape in expected.items():
        tensor, f = tensors[name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f, f"tensor {name} has shape {tuple(tensor.shape)}, config.json implies {shape}")


def _to_our_layout(
    tensors: dict[str, tuple[torch.Tensor, Path]], args: ModelArgs, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    def get(name: str) -> torch.Tensor:
        return tensors[name][0].to(dtype)

    sd = {"embed_tokens.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    sd["lm_head.weight"] = sd["embed_tokens.weight"] if args.tie_word_embeddings else get("lm_head.weight")
    for i in range(args.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                if f"{hf}{parts[0]}.{kind}" in tensors:
                    sd[f"{ours}{fused}.{kind}"] = torch.cat([get(f"{hf}{p}.{kind}") for p in parts])
        for plain in _PLAIN:
            for kind in ("weight", "bias"):
                if f"{hf}{plain}.{kind}" in tensors:
                    sd[f"{ours}{plain}.{kind}"] = get(f"{hf}{plain}.{kind}")
    return sd


def _eos_ids(root: Path, config: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
    for source in (_read_json(root / "generation_config.json", required=False), config):
        eos = source.get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    token = _read_json(root / "tokenizer_config.json", required=False).get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
    return (token_id,) if token_id is not None else ()


def resolve_dtype(name: str, config: dict[str, Any]) -> torch.dtype:
    if name == "auto":
        name = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    if name not in DTYPES:
        raise CheckpointError("dtype", f"unsupported dtype {name!r}; use one of float32, bfloat16, float16")
    return DTYPES[name]


def load_checkpoint(path: str | Path, dtype: str = "auto") -> Checkpoint:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(root, "is not a directory")
    config_path = root / "config.json"
    config = _read_json(config_path)
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
    torch_dtype = resolve_dtype(dtype, config)
    tensors = _read_tensors(_weight_files(root))
    _check(tensors, args, root)
    return Checkpoint(
        path=root,
        name=root.name,
        args=args,
        dtype=torch_dtype,
        state_dict=_to_our_layout(tensors, args, torch_dtype),
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(root, config, tokenizer),
        bos_token_id=config.get("bos_token_id"),
    )
