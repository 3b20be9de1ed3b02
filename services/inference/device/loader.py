"""Reads a local Hugging Face checkpoint directory into our parameter layout: its header (checkpoint.py, no
torch), then its weights, checked against the header's config.

Every problem with the directory is one `CheckpointError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from .checkpoint import CheckpointError, CheckpointHeader, read_header, read_json
from .config import ModelArgs
from .int8_checkpoint import split_int8

__all__ = ["Checkpoint", "CheckpointError", "load_checkpoint"]
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {  # our fused parameter -> the Hugging Face parameters concatenated into it, in order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_PLAIN = ("self_attn.o_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")


@dataclass(frozen=True)
class Checkpoint:
    header: CheckpointHeader
    dtype: torch.dtype  # the header's dtype
    state_dict: dict[str, torch.Tensor]  # our layout (model.py's parameter names)
    # a pre-quantized checkpoint's layer linears as stored, our names: "layers.0.mlp.down_proj.weight" -> (q int8
    # [N, K], scale fp32 [N]); their state_dict entries hold q * scale in dtype. Empty for a float checkpoint.
    int8: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.header.path

    @property
    def name(self) -> str:
        return self.header.name

    @property
    def args(self) -> ModelArgs:
        return self.header.args

    @property
    def tokenizer(self) -> Tokenizer:
        return self.header.tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.header.eos_token_ids


def _weight_files(root: Path) -> list[Path]:
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    index_path = root / "model.safetensors.index.json"
    if not index_path.is_file():
        raise CheckpointError(root / "model.safetensors", "file is missing (and no model.safetensors.index.json)")
    weight_map = read_json(index_path).get("weight_map")
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


def _int8_layout(
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]], args: ModelArgs, root: Path
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The stored int8 weights in our layout: fused ones concatenated by rows, with their per-row scales."""
    out = {}
    for i in range(args.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for name, parts in (*_FUSED.items(), *((plain, (plain,)) for plain in _PLAIN if plain.endswith("_proj"))):
            keys = [f"{hf}{part}.weight" for part in parts]
            found = [k in stored for k in keys]
            if any(found) and not all(found):
                raise CheckpointError(root, f"{', '.join(keys)} must all be int8 or none, they are fused into one")
            if all(found):
                out[f"{ours}{name}.weight"] = tuple(torch.cat([stored[k][j] for k in keys]) for j in (0, 1))
    return out


def load_checkpoint(path: str | Path, dtype: str = "auto") -> Checkpoint:
    header = read_header(path, dtype)
    torch_dtype = getattr(torch, header.dtype)
    tensors = _read_tensors(_weight_files(header.path))
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if header.quantization == "int8":
        tensors, stored = split_int8(tensors)
    _check(tensors, header.args, header.path)
    layout = _to_our_layout(tensors, header.args, torch_dtype)
    return Checkpoint(header, torch_dtype, layout, _int8_layout(stored, header.args, header.path))
