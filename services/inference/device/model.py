"""A Llama-family decoder (Llama, Mistral, Qwen2) in plain PyTorch.

Tokens of a step are flattened: T tokens from several sequences, each with its own position and KV blocks.
The attention backend (attention.py) owns the static KV cache and knows which tokens belong together.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionBackend, AttentionMetadata
from .config import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the model dtype, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add, then this norm: (norm(x + residual), x + residual). One kernel on the CPU path."""
        h = x + residual
        return self(h), h


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """[head_dim/2] inverse frequencies, with `linear` or `llama3` scaling applied."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended smoothly.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_seq_len), computed once in fp32."""

    def __init__(self, args: ModelArgs, max_seq_len: int) -> None:
        super().__init__()
        self.args = args
        self.max_seq_len = max_seq_len
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(self.args)
        positions = torch.arange(self.max_seq_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_seq_len, head_dim/2]
        self.cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1).to(device=device, dtype=dtype)
        # the sign of rotate_half folded into sin: [-sin, sin], so rotating needs no negation op
        self.sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T] -> cos, sin [T, 1, head_dim], broadcast over heads
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, head_dim]; rotates the two halves of head_dim (the Hugging Face convention, whose
    # rotate_half(x) * sin equals cat(x2, x1) * [-sin, sin], bit for bit)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.args = args
        self.layer_idx = layer_idx
        self.scale = args.head_dim**-0.5
        # q, k and v share one matmul: [hidden] -> [q_size + 2 * kv_size]
        self.qkv_proj = nn.Linear(args.hidden_size, args.q_size + 2 * args.kv_size, bias=args.attention_bias)
        self.o_proj = nn.Linear(args.q_size, args.hidden_size, bias=args.o_proj_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend, meta: AttentionMetadata
    ) -> torch.Tensor:
        a = self.args
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        heads = a.num_attention_heads + a.num_key_value_heads
        # q and k are adjacent in qkv: rotate them in one go, [T, H + KVH, D]
        qk = apply_rotary(qkv[:, : a.q_size + a.kv_size].view(-1, heads, a.head_dim), cos, sin)
        q, k = qk.split([a.num_attention_heads, a.num_key_value_heads], dim=1)  # [T, H, D], [T, KVH, D]
        v = qkv[:, a.q_size + a.kv_size :].view(-1, a.num_key_value_heads, a.head_dim)  # [T, KVH, D]
        out = backend.forward(self.layer_idx, q, k, v, self.scale, meta)  # [T, H, D]
        return self.o_proj(out.reshape(-1, a.q_size))


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        # [T, 2 * intermediate] -> [T, intermediate]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        # gate and up share one matmul: [hidden] -> [2 * intermediate]
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.act = SiluAndMul()
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it); the stream is
        residual + x, each residual add done by the norm that follows it (fused on the CPU path)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_forward(x, residual)
        x, residual = self.post_attention_layernorm.add_forward(self.self_attn(x, cos, sin, backend, meta), residual)
        return self.mlp(x), residual


class DecoderStack(nn.ModuleList):
    """The decoder layers, run in order; a ModuleList, so the weights keep their names (layers.{i}.…)."""

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden], positions [T] -> (the last layer's MLP output, the residual stream before it)."""
        cos, sin = rotary(positions)
        residual = None
        for layer in self:
            h, residual = layer(h, residual, cos, sin, backend, meta)
        return h, residual


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, max_seq_len: int) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = DecoderStack(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(args, max_seq_len)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> fp32 logits [N, vocab] for the N rows picked by logits_indices."""
        # [T, hidden] each
        h, residual = self.layers(self.embed_tokens(input_ids), positions, self.rotary, backend, meta)
        # [N, hidden]: only the rows we sample from
        h, _ = self.norm.add_forward(h[logits_indices], residual[logits_indices])
        return self.lm_head(h).float()
