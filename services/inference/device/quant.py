"""Weight-only quantization of the decoder layers' linear weights (issue 34): what `--quantize` names, how a weight
becomes int8 and back. Symmetric, one scale per output channel: measured against per-group scales on the bundled
model's NLL (BENCHMARKS.md, "Quantized weights"), and it is the layout the int8 kernel scales after its K loop.

The embedding, the final norm and the LM head keep the checkpoint's dtype: the LM head's product feeds the sampler
directly, and a tied head shares its weight with the embedding."""

from __future__ import annotations

import torch
from torch import nn

INT8_MAX = 127  # symmetric: -127..127, so that -q is always representable and zero is exact


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (q int8 [N, K], scale fp32 [N]) with w ≈ q * scale[:, None], rounded to nearest
    in fp32. A row of zeros gets scale 1 (its q are zeros), so no scale is ever 0 or NaN."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.clamp(torch.round(wf / scale[:, None]), -INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q int8 [N, K], scale [N] -> q * scale[:, None] in `dtype` (computed in fp32, rounded once)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def fake_quantize_layers(layers: nn.Module) -> int:
    """The plain-torch fallback of --quantize int8 (no CPU kernels: another ISA, fp16, a GPU): every nn.Linear under
    `layers` gets a new weight, its own quantized and dequantized, so the replica computes with the int8 model's
    values (not its speed or memory). New tensors, not in place: the model's weights are the checkpoint's own
    (loaded with assign=True), which another executor may be built from. Returns how many weights."""
    linears = [m for m in layers.modules() if isinstance(m, nn.Linear)]
    for linear in linears:
        q, scale = quantize_int8(linear.weight)
        linear.weight = nn.Parameter(dequantize_int8(q, scale, linear.weight.dtype), requires_grad=False)
    return len(linears)
