"""The model's layers on the CPU kernels (services/inference/kernels): linear layers with weights packed once,
and RMSNorm and SiLU·up each in one op instead of several small ones."""
from __future__ import annotations

import torch
from torch import nn

from .kernels import CpuOps
from .model import RMSNorm, SiluAndMul


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


class KernelSiluAndMul(nn.Module):
    def __init__(self, ops: CpuOps) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(gate_up)


def pack_model(model: nn.Module, ops: CpuOps) -> int:
    """Swaps the layers of `model` that have a kernel for their kernel versions; returns how many."""
    swaps = {nn.Linear: lambda m: PackedLinear(m, ops), RMSNorm: lambda m: KernelRMSNorm(m, ops),
             SiluAndMul: lambda m: KernelSiluAndMul(ops)}
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) in swaps]
    for parent, name, child in targets:
        setattr(parent, name, swaps[type(child)](child))
    return len(targets)
