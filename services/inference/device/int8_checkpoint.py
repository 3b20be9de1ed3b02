"""Pre-quantized int8 checkpoints (issue 34), in compressed-tensors' "int-quantized" layout: each decoder layer's
linear weight `<name>.weight` stored as int8 [N, K] beside `<name>.weight_scale` [N, 1] (fp32 here; any float read),
w = q * scale, symmetric per output channel; everything else (embedding, norms, LM head) as a float checkpoint has
it; config.json's `quantization_config` says so (checkpoint.py reads it).

`zeroqueue quantize` writes one from an ordinary checkpoint with quant.py's scheme (int8_writer.py), so serving it is
exactly `--quantize int8` on the original without the original; the loader reads it (split_int8)."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import INT8_FORMAT, CheckpointError
from .quant import dequantize_int8

SCALE_SUFFIX = "_scale"
WEIGHTS_FILE = "model.safetensors"
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": INT8_FORMAT,
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": ["lm_head"],
}


def is_layer_linear(name: str, tensor: torch.Tensor) -> bool:
    """A decoder layer's linear weight (q/k/v/o, gate/up/down), by its Hugging Face name."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight") and tensor.dim() == 2


def split_int8(
    tensors: dict[str, tuple[torch.Tensor, Path]],
) -> tuple[dict[str, tuple[torch.Tensor, Path]], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A pre-quantized checkpoint's tensors -> (the same with each int8 weight dequantized to fp32 and the scales
    gone, so they check and load as a float checkpoint's; {Hugging Face weight name: (q int8 [N, K], scale fp32
    [N])} as stored). CheckpointError for a weight without its scale, a scale without its weight or of the wrong
    shape, or a scale that is not positive and finite."""
    plain = {k: v for k, v in tensors.items() if not k.endswith(SCALE_SUFFIX)}
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (scale, path) in ((k, v) for k, v in tensors.items() if k.endswith(SCALE_SUFFIX)):
        weight = name[: -len(SCALE_SUFFIX)]
        if weight not in plain or plain[weight][0].dtype != torch.int8:
            raise CheckpointError(path, f"{name} scales no int8 tensor {weight}")
        q = plain[weight][0]
        if scale.numel() != q.shape[0] or scale.dim() not in (1, 2) or (scale.dim() == 2 and scale.shape[1] != 1):
            raise CheckpointError(path, f"{name} has shape {tuple(scale.shape)}, expected [{q.shape[0]}, 1]")
        s = scale.float().reshape(-1)
        if not bool(torch.isfinite(s).all() and (s > 0).all()):
            raise CheckpointError(path, f"{name} has a scale that is not positive and finite")
        stored[weight] = (q, s)
        plain[weight] = (dequantize_int8(q, s, torch.float32), plain[weight][1])
    for name, (t, path) in plain.items():
        if t.dtype == torch.int8 and name not in stored:
            raise CheckpointError(path, f"int8 tensor {name} has no {name}{SCALE_SUFFIX}")
    return plain, stored
