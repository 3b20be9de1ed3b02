"""Shape-only (fake) implementations of the zeroqueue CPU ops, registered once the kernels load, so the ops can sit
inside torch.compile graphs."""

from __future__ import annotations

import torch


def register_fakes(lanes: int) -> None:
    """Shape-only implementations, so the ops can sit inside torch.compile graphs; `lanes`: output columns per packed
    weight panel."""

    @torch.library.register_fake("zeroqueue::pack_linear")
    def _pack_linear(w: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        panels = -(-n // lanes)
        if w.dtype in (torch.bfloat16, torch.int8):
            return w.new_empty((panels, -(-k // 2), lanes, 2))
        return w.new_empty((panels, k, lanes))

    @torch.library.register_fake("zeroqueue::linear")
    def _linear(
        x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, bf16_path: int = 0
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("zeroqueue::linear_int8")
    def _linear_int8(x, packed, scales, bias, n: int, bf16_path: int = 0) -> torch.Tensor:
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("zeroqueue::linear_int4")
    def _linear_int4(x, packed, scales, bias, n: int, bf16_path: int = 0) -> torch.Tensor:
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("zeroqueue::rms_norm")
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake("zeroqueue::add_rms_norm")
    def _add_rms_norm(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("zeroqueue::rope_cache")
    def _rope_cache(qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads) -> torch.Tensor:
        return qkv.new_empty((qkv.shape[0], heads, k_cache.shape[-1]))

    @torch.library.register_fake("zeroqueue::silu_mul")
    def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))

    @torch.library.register_fake("zeroqueue::apply_token_bitmask")
    def _apply_token_bitmask(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        return logits.new_empty((logits.shape[0],), dtype=torch.int64)

    @torch.library.register_fake("zeroqueue::decode_layers")
    def _decode_layers(x, weights, biases, scales, out_features, *rest) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("zeroqueue::decode_attention")
    def _decode_attention(q, k_cache, v_cache, slots, lengths, scale) -> torch.Tensor:
        return torch.empty_like(q)
