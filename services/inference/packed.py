"""The model's layers on the CPU kernels (services/inference/kernels): linear layers with weights packed once;
RMSNorm (with the residual add before it), SiLU·up, and the rotary embedding with the KV-cache write, each in
one op instead of several small ones."""
from __future__ import annotations

import torch
from torch import nn

from .kernels import CpuOps
from .attention import AttentionBackend, AttentionMetadata
from .model import Attention, RMSNorm, RotaryEmbedding, SiluAndMul


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, ops: CpuOps) -> None:
        super().__init__()
        self.ops = ops
        self.out_features = linear.out_features
        self.register_buffer("packed", ops.pack_linear(linear.weight.detach()), persistent=False)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [M, in_features] -> [M, out_features]
        return self.ops.linear(x, self.packed, self.bias, self.out_features)


class KernelRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm, ops: CpuOps) -> None:
        super().__init__()
        self.ops, self.weight, self.eps = ops, norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class KernelAttention(nn.Module):
    """Attention with the rotary embedding and the KV-cache write in one op (the model's tables, read at
    each token's position), then the backend's attention over the cache."""

    def __init__(self, attn: Attention, rotary: RotaryEmbedding, ops: CpuOps) -> None:
        super().__init__()
        self.ops, self.args, self.layer_idx, self.scale = ops, attn.args, attn.layer_idx, attn.scale
        self.qkv_proj, self.o_proj = attn.qkv_proj, attn.o_proj
        self.tables = (rotary,)         # a tuple: the model owns the module (and rebuilds its tables)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        a, rotary, layer = self.args, self.tables[0], self.layer_idx
        q = self.ops.rope_cache(self.qkv_proj(x), rotary.cos, rotary.sin, meta.positions, meta.slot_ids,
                                backend.cache.k_layers[layer], backend.cache.v_layers[layer],
                                a.num_attention_heads, a.num_key_value_heads)            # [T, H, D]
        return self.o_proj(backend.attend(layer, q, self.scale, meta).reshape(-1, a.q_size))


class KernelSiluAndMul(nn.Module):
    def __init__(self, ops: CpuOps) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(gate_up)


def pack_model(model: nn.Module, ops: CpuOps) -> int:
    """Swaps the layers of the Transformer `model` that have a kernel for their kernel versions; returns how
    many (attention first, so that its linear layers are then packed in place)."""
    swaps = {Attention: lambda m: KernelAttention(m, model.rotary, ops)}
    count = _swap(model, swaps)
    swaps = {nn.Linear: lambda m: PackedLinear(m, ops), RMSNorm: lambda m: KernelRMSNorm(m, ops),
             SiluAndMul: lambda m: KernelSiluAndMul(ops)}
    return count + _swap(model, swaps)


def _swap(model: nn.Module, swaps: dict) -> int:
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) in swaps]
    for parent, name, child in targets:
        setattr(parent, name, swaps[type(child)](child))
    return len(targets)
