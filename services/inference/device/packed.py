"""The model's layers on the CPU kernels (services/inference/device/kernels): linear layers with weights packed once;
RMSNorm (with the residual add before it), SiLU·up, and the rotary embedding with the KV-cache write, each in
one op instead of several small ones; and a step's layers all in one op."""

from __future__ import annotations

import torch
from torch import nn

from .attention import AttentionBackend, AttentionMetadata
from .kernels import CpuOps
from .model import Attention, DecoderStack, RMSNorm, RotaryEmbedding, SiluAndMul
from .quant import INT4_GROUP, quantize_int4, quantize_int8


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


class QuantizedLinear(nn.Module):
    """A linear layer with quantized weights, packed as `op` (CpuOps.linear_int8 / linear_int4) reads them with their
    scales; x and y keep their dtype."""

    def __init__(self, linear: nn.Linear, op, packed: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.op = op
        self.out_features = linear.out_features
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [M, in_features] -> [M, out_features]
        shape = x.shape
        y = self.op(x.reshape(-1, shape[-1]), self.packed, self.scales, self.bias, self.out_features)
        return y.reshape(*shape[:-1], self.out_features)


class Int8Linear(QuantizedLinear):
    """int8 weights (quant.py's symmetric per-channel scheme, scales fp32 [out_features]): `stored` (q, scales) as a
    pre-quantized checkpoint holds them, else quantized from `linear`'s weight; packed for ops.int_path
    (zeroqueue::linear_int8)."""

    def __init__(self, linear: nn.Linear, ops: CpuOps, stored: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        q, scales = stored if stored is not None else quantize_int8(linear.weight)
        super().__init__(linear, ops.linear_int8, ops.pack_int8(q), scales)


class Int4Linear(QuantizedLinear):
    """int4 weights (quant.py's symmetric scheme, one scale per group of INT4_GROUP inputs), quantized from
    `linear`'s weight, packed for ops.int_path (zeroqueue::linear_int4)."""

    def __init__(self, linear: nn.Linear, ops: CpuOps) -> None:
        q, scale = quantize_int4(linear.weight, INT4_GROUP)
        super().__init__(linear, ops.linear_int4, *ops.pack_int4(q, scale, INT4_GROUP))


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
        self.tables = (rotary,)  # a tuple: the model owns the module (and rebuilds its tables)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend, meta: AttentionMetadata
    ) -> torch.Tensor:
        a, rotary, layer = self.args, self.tables[0], self.layer_idx
        q = self.ops.rope_cache(
            self.qkv_proj(x),
            rotary.cos,
            rotary.sin,
            meta.positions,
            meta.slot_mapping,
            backend.cache.k_layers[layer],
            backend.cache.v_layers[layer],
            a.num_attention_heads,
            a.num_key_value_heads,
        )  # [T, H, D]
        return self.o_proj(backend.attend(layer, q, self.scale, meta).reshape(-1, a.q_size))


class KernelSiluAndMul(nn.Module):
    def __init__(self, ops: CpuOps) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(gate_up)


class KernelDecoderStack(DecoderStack):
    """The decoder layers on the kernels, all of them in one op a step (zeroqueue::decode_layers). Every row
    attends from its own position over its sequence's blocks, which the op has just written for all the step's
    rows; a prompt chunk's rows are thus causal, and a decode-only step is bit-identical to running the
    layers one by one. The weights are gathered once: the executor never swaps a tensor of a packed model."""

    def __init__(self, stack: DecoderStack, ops: CpuOps) -> None:
        super().__init__(stack)
        self.ops = ops
        attn = stack[0].self_attn
        self.heads, self.kv_heads = attn.args.num_attention_heads, attn.args.num_key_value_heads
        self.eps, self.scale = stack[0].input_layernorm.eps, attn.scale
        linears = [
            (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            for layer in stack
        ]
        self.out_features = [lin.out_features for lin in linears[0]]
        self.weights = [
            w
            for layer, (qkv, o, gate_up, down) in zip(stack, linears)
            for w in (
                layer.input_layernorm.weight,
                qkv.packed,
                o.packed,
                layer.post_attention_layernorm.weight,
                gate_up.packed,
                down.packed,
            )
        ]
        self.biases = [lin.bias for four in linears for lin in four]
        self.scales = [getattr(lin, "scales", None) for four in linears for lin in four]  # None: not quantized

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if backend.decode_kernel is None:  # a head size the attention kernel is not built for
            return super().forward(h, positions, rotary, backend, meta)
        # the op reads the whole cos/sin tables at each row's position: no per-step lookup of them here
        decode_only = meta.num_decode == h.shape[0]
        lengths = meta.decode_lens if decode_only else meta.positions + 1  # [T]: each row sees [0, pos]
        return self.ops.decode_layers(
            h,
            self.weights,
            self.biases,
            self.scales,
            self.out_features,
            rotary.cos,
            rotary.sin,
            meta.positions,
            meta.slot_mapping,
            meta.block_tables,
            lengths,
            backend.cache.k,
            backend.cache.v,
            self.heads,
            self.kv_heads,
            self.eps,
            self.scale,
        )


def pack_model(model: nn.Module, ops: CpuOps, quantize: str = "none", stored: dict[str, tuple] | None = None) -> int:
    """Swaps the layers of the Transformer `model` that have a kernel for their kernel versions; returns how
    many (attention first, so that its linear layers are then packed in place; the stack of layers last, as it
    gathers their packed weights). quantize "int8": the decoder layers' linears get int8 weights, `stored`'s where it
    has them by parameter name (a pre-quantized checkpoint's), else quantized here (quant.py), and so does the LM
    head (quantized here: the pre-quantized format leaves it out). "int4": the decoder layers' linears get int4
    weights, the LM head int8 (BENCHMARKS.md, "int4 weights": int4 there cost more NLL than it saved time)."""
    names = {id(m): name for name, m in model.named_modules()}  # before the swaps move them
    stored = stored or {}
    swaps = {Attention: lambda m: KernelAttention(m, model.rotary, ops)}
    count = _swap(model, swaps)
    if quantize == "int4":
        count += _swap(model.layers, {nn.Linear: lambda m: Int4Linear(m, ops)})
    elif quantize == "int8":
        count += _swap(model.layers, {nn.Linear: lambda m: Int8Linear(m, ops, stored.get(f"{names[id(m)]}.weight"))})
    if quantize in ("int8", "int4"):
        # the LM head too: at batch 1 it is a fifth of the bytes a step reads (SmolLM2-135M), and int8 left the
        # bundled model's NLL unchanged (BENCHMARKS.md); a tied embedding keeps its own weight for the lookup
        model.lm_head = Int8Linear(model.lm_head, ops)
        count += 1
    swaps = {
        nn.Linear: lambda m: PackedLinear(m, ops),
        RMSNorm: lambda m: KernelRMSNorm(m, ops),
        SiluAndMul: lambda m: KernelSiluAndMul(ops),
    }
    count += _swap(model, swaps)
    return count + _swap(model, {DecoderStack: lambda m: KernelDecoderStack(m, ops)})


def _swap(model: nn.Module, swaps: dict) -> int:
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in swaps
    ]
    for parent, name, child in targets:
        setattr(parent, name, swaps[type(child)](child))
    return len(targets)
