"""Weight-only quantization of the linear weights (issue 34): how a weight becomes int8, int4 (or FP8) and back.

int8: symmetric, one scale per output channel (per-group scales bought nothing in the bundled model's NLL:
BENCHMARKS.md, "Quantized weights"), the layout the int8 kernel scales after its K loop. It takes the decoder
layers' linears and the LM head (a fifth of a step's bytes on SmolLM2-135M; measured faster at batch 1 and 8 and no
worse in NLL). int4: symmetric per group of INT4_GROUP inputs (+0.08 % NLL; asymmetric was +0.03 % but needs a zero
point per group in the kernel), for the decoder layers' linears; the LM head stays int8 (int4 there: +0.29 %). The
embedding (a lookup: one row a token) and the norms keep the checkpoint's dtype, and a tied embedding keeps its own
weight. fp8 takes the decoder layers' linears only."""

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


def pack_int8_vnni(q: torch.Tensor, lanes: int = 16) -> torch.Tensor:
    """q int8 [N, K] -> int8 [ceil(N/lanes), ceil(K/4), lanes, 4] as zeroqueue::linear_int8's VNNI path reads it: lane j
    of step t holds q[n0 + j, 4t : 4t + 4], each byte q + 128 (VPDPBUSD's unsigned operand; the kernel takes the 128
    back out). Padding is q = 0."""
    n, k = q.shape
    padded = nn.functional.pad(q, (0, -k % 4, 0, -n % lanes))
    quads = padded.reshape(-1, lanes, padded.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()
    return quads.bitwise_xor(torch.tensor(-128, dtype=torch.int8))


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], scale fp32 [M]) as the VNNI path quantizes a call's rows: q = round(x * (127 /
    amax)) to nearest even in fp32, scale amax / 127 (0 for a row of zeros, whose q are zeros)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    # a tensor over a tensor: `127 / amax` would be reciprocal(amax) * 127, rounded twice, not the kernel's division
    inv = torch.where(amax > 0, torch.full_like(amax, INT8_MAX) / amax, torch.zeros_like(amax))
    return torch.round(xf * inv[:, None]).to(torch.int8), amax / INT8_MAX


def linear_int8_vnni_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the VNNI path computes, in plain torch: x's rows quantized (quantize_rows_int8), the integer products
    summed exactly, then times the row's and the column's factor, plus bias; in x's dtype."""
    xq, xs = quantize_rows_int8(x)
    acc = (xq.to(torch.int64) @ q.to(torch.int64).T).float()  # the exact sums, rounded to fp32 as the kernel does
    y = acc * xs[:, None] * scale.float()[None, :]
    return (y if bias is None else y + bias.float()).to(x.dtype)


# ---- int4: symmetric per group of INT4_GROUP inputs, 16 levels (-8..7), as llama.cpp's Q4_0 ----
INT4_GROUP = 64  # inputs per scale: chosen by NLL on the bundled model (BENCHMARKS.md, "int4 weights")


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K] in -8..7, scale fp32 [N, ceil(K / group)]) with w ≈ q * scale per group of `group`
    inputs. A group's weight of largest magnitude m maps to -8 exactly (scale m / -8, negative where m is), the others
    round to nearest in fp32 and clamp at 7: all 16 levels used, no zero point. A group of zeros gets scale 1."""
    if group < 4 or group % 4:
        raise ValueError(f"int4 groups must hold a multiple of 4 inputs (a kernel step), not {group}")
    n, k = w.shape
    groups = -(-k // group)
    wf = nn.functional.pad(w.detach().float(), (0, groups * group - k)).reshape(n, groups, group)
    m = wf.gather(-1, wf.abs().argmax(-1, keepdim=True)).squeeze(-1)  # [N, G]
    scale = torch.where(m != 0, m / -8, torch.ones_like(m))
    q = torch.clamp(torch.round(wf / scale[..., None]), -8, 7).to(torch.int8)
    return q.reshape(n, -1)[:, :k].contiguous(), scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, group: int = INT4_GROUP) -> torch.Tensor:
    """q int8 [N, K], scale [N, G] of groups of `group` inputs -> q * scale per group in `dtype` (computed in fp32,
    rounded once)."""
    n, k = q.shape
    groups = scale.shape[1]
    g = nn.functional.pad(q.float(), (0, groups * group - k)).reshape(n, groups, group)
    return (g * scale.float()[..., None]).reshape(n, -1)[:, :k].to(dtype)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, group: int, lanes: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int4's (q [N, K], scale [N, G]) -> the layout zeroqueue::linear_int4 reads: packed uint8
    [NP, G * group / 4, lanes, 2] (step t, column j: the bytes w[4t] | w[4t+2] << 4 and w[4t+1] | w[4t+3] << 4, each
    weight + 8) and scales fp32 [NP, G, lanes]; columns past N and inputs past K are zero weights."""
    n, k = q.shape
    groups = scale.shape[1]
    panels = -(-n // lanes)
    biased = nn.functional.pad(q.to(torch.int16) + 8, (0, groups * group - k, 0, panels * lanes - n), value=8)
    low = biased[:, 0::4] | (biased[:, 2::4] << 4)  # [NP * lanes, KQ]
    high = biased[:, 1::4] | (biased[:, 3::4] << 4)
    quads = torch.stack([low, high], dim=-1).to(torch.uint8)  # [NP * lanes, KQ, 2]
    packed = quads.reshape(panels, lanes, -1, 2).permute(0, 2, 1, 3).contiguous()
    scales = nn.functional.pad(scale.float(), (0, 0, 0, panels * lanes - n), value=1.0)
    return packed, scales.reshape(panels, lanes, groups).permute(0, 2, 1).contiguous()


def pack_int4_vnni(
    q: torch.Tensor, scale: torch.Tensor, group: int, lanes: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int4's (q [N, K], scale [N, G]) -> the layout zeroqueue::linear_int4's VNNI path reads: packed uint8
    [NP, G * group / 8, lanes, 4] (double step d, column j, byte b: w[8d + b] + 8 in the low nibble, w[8d + 4 + b] + 8
    in the high) and scales fp32 [NP, G, lanes] as pack_int4's; columns past N and inputs past K are zero weights.
    `group` must hold a multiple of 16 inputs (a vector of x)."""
    if group % 16:
        raise ValueError(f"the VNNI layout needs groups of a multiple of 16 inputs, not {group}")
    n, k = q.shape
    groups = scale.shape[1]
    panels = -(-n // lanes)
    biased = nn.functional.pad(q.to(torch.int16) + 8, (0, groups * group - k, 0, panels * lanes - n), value=8)
    halves = biased.reshape(panels, lanes, -1, 2, 4)  # [NP, lanes, D, low / high, byte]
    packed = (halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)).permute(0, 2, 1, 3).to(torch.uint8).contiguous()
    scales = nn.functional.pad(scale.float(), (0, 0, 0, panels * lanes - n), value=1.0)
    return packed, scales.reshape(panels, lanes, groups).transpose(1, 2).contiguous()


def linear_int4_vnni_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What linear_int4's VNNI path computes, in plain torch: x's rows quantized (quantize_rows_int8), each group's
    integer products summed exactly, times the group's scale per column and added up in fp32, then times the row's
    factor, plus bias; in x's dtype."""
    xq, xs = quantize_rows_int8(x)
    y = torch.zeros(x.shape[0], q.shape[0])
    for g in range(scale.shape[1]):
        part = xq[:, g * group : (g + 1) * group].to(torch.int64) @ q[:, g * group : (g + 1) * group].to(torch.int64).T
        y = y + part.float() * scale.float()[:, g]
    y = y * xs[:, None]
    return (y if bias is None else y + bias.float()).to(x.dtype)


def fake_quantize_linears(*modules: nn.Module, bits: int = 8) -> int:
    """The plain-torch fallback of --quantize int8 / int4 (no CPU kernels: another ISA, fp16, a GPU): every nn.Linear
    in `modules` (the decoder layers, the LM head) gets a new weight, its own quantized (`bits` 8 or 4) and
    dequantized, so the replica computes with the quantized model's values (not its speed or memory). New tensors,
    not in place: the model's weights are the checkpoint's own (loaded with assign=True), which another executor may
    be built from, and a tied LM head's is the embedding's. Returns how many weights."""
    linears = [m for module in modules for m in module.modules() if isinstance(m, nn.Linear)]
    quantize, dequantize = (quantize_int8, dequantize_int8) if bits == 8 else (quantize_int4, dequantize_int4)
    for linear in linears:
        q, scale = quantize(linear.weight)
        linear.weight = nn.Parameter(dequantize(q, scale, linear.weight.dtype), requires_grad=False)
    return len(linears)


# ---- FP8 (E4M3) on CUDA devices that have it (compute capability 8.9+: Ada, Hopper) ----
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q float8_e4m3fn [N, K], scale fp32 [N]) with w ≈ q * scale[:, None], one scale per output
    channel (amax / 448; a row of zeros gets 1)."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (wf / scale.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class Fp8Linear(nn.Module):
    """A linear layer on FP8 tensor cores: weights E4M3 per output channel, each row of x quantized to E4M3 with its
    own scale as it comes (so a row's scale does not depend on its batch), one torch._scaled_mm with row-wise scales,
    bf16 out. No host sync: it runs inside the CUDA-graph buckets. _scaled_mm needs K and N multiples of 16."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        n, k = linear.weight.shape
        if n % 16 or k % 16:
            raise ValueError(f"fp8 needs linear layers whose sizes are multiples of 16, not [{n}, {k}]")
        q, scale = quantize_fp8(linear.weight)
        self.out_features = n
        self.register_buffer("weight_t", q.t(), persistent=False)  # [K, N], column-major as _scaled_mm takes it
        self.register_buffer("scale_row", scale.unsqueeze(0).contiguous(), persistent=False)  # [1, N]
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()  # [M, K]
        scale = torch.clamp(rows.abs().amax(dim=1, keepdim=True) / FP8_MAX, min=1e-12)  # [M, 1]
        xq = (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.weight_t, scale_a=scale, scale_b=self.scale_row, out_dtype=torch.bfloat16)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def fp8_layers(layers: nn.Module) -> int:
    """Every nn.Linear under `layers` swapped for an Fp8Linear quantized from it; returns how many."""
    targets = [(p, name, c) for p in layers.modules() for name, c in p.named_children() if type(c) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, Fp8Linear(child))
    return len(targets)
