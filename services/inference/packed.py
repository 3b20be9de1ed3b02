"""Linear layers whose weights are packed once for the CPU kernels (services/inference/kernels)."""
from __future__ import annotations

import torch
from torch import nn

from .kernels import CpuOps


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


def pack_model(model: nn.Module, ops: CpuOps) -> int:
    """Swaps every nn.Linear of `model` for a PackedLinear; returns how many were swapped."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, ops))
    return len(targets)
