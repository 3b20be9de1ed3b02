"""The static KV cache and the attention over it.

Layout: k, v [layers, slots + 1, kv_heads, max_seq_len, head_dim]. One slot holds one sequence; the extra
last slot is scratch that padded rows of a batch bucket write into, so they never touch a live sequence.
Both tensors are allocated once and never reallocated while serving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillChunk:
    token_offset: int  # row of the chunk's first token in the flattened step
    num_tokens: int
    slot: int
    start_pos: int  # tokens [0, start_pos) of this sequence are already in the cache


@dataclass(frozen=True)
class AttentionMetadata:
    slot_ids: torch.Tensor  # [T] int64: cache slot of each token (scratch slot for padding)
    positions: torch.Tensor  # [T] int64
    num_decode: int  # rows [0, num_decode) are decode tokens, one per sequence
    decode_slots: torch.Tensor  # [num_decode] int64
    decode_lens: torch.Tensor  # [num_decode] int64: context length including the new token
    max_decode_len: int  # attend over cache positions [0, max_decode_len) for decode rows
    prefills: tuple[PrefillChunk, ...] = ()


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots + 1, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        # per-layer views [slots + 1, KVH, max_seq_len, D], made once: selecting a layer costs a dispatch
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * max_seq_len * head_dim * dtype.itemsize


DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class AttentionBackend:
    """Writes a step's k/v into the cache, then attends: decode rows batched, prefill chunks one by one."""

    def __init__(self, cache: KVCache, decode_kernel: DecodeKernel | None = None) -> None:
        self.cache = cache
        self.decode_kernel = decode_kernel

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, meta: AttentionMetadata
    ) -> torch.Tensor:
        # q [T, H, D]; k, v [T, KVH, D] -> out [T, H, D]
        kc, vc = self.cache.k_layers[layer], self.cache.v_layers[layer]  # [slots + 1, KVH, max_seq_len, D]
        kc[meta.slot_ids, :, meta.positions] = k
        vc[meta.slot_ids, :, meta.positions] = v
        return self.attend(layer, q, scale, meta)

    def attend(self, layer: int, q: torch.Tensor, scale: float, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D] -> out [T, H, D], the step's k and v already in the cache."""
        kc, vc = self.cache.k_layers[layer], self.cache.v_layers[layer]
        if meta.num_decode == q.shape[0] and not meta.prefills:
            return self._decode(q, kc, vc, scale, meta)
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(q[: meta.num_decode], kc, vc, scale, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.token_offset, chunk.token_offset + chunk.num_tokens)
            out[rows] = _prefill(q[rows], kc, vc, chunk, scale)
        return out

    def _decode(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.decode_kernel is not None:
            return self.decode_kernel(q, kc, vc, meta.decode_slots, meta.decode_lens, scale)
        return _decode_sdpa(q, kc, vc, scale, meta)


def _decode_sdpa(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float, meta: AttentionMetadata
) -> torch.Tensor:
    # q [B, H, D]; gathers [B, KVH, L, D] with L = max_decode_len and masks each row past its length.
    n = meta.max_decode_len
    k = kc[meta.decode_slots, :, :n]
    v = vc[meta.decode_slots, :, :n]
    mask = torch.arange(n, device=q.device)[None, :] < meta.decode_lens[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )  # [B, H, 1, D]
    return out.squeeze(2)


def _prefill(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    # q [n, H, D] attends causally to cache positions [0, start_pos + n) of its slot.
    end = chunk.start_pos + chunk.num_tokens
    k = kc[chunk.slot, :, :end]  # [KVH, end, D], a view
    v = vc[chunk.slot, :, :end]
    group = q.shape[1] // k.shape[0]
    if group > 1:
        # SDPA's fused CPU kernel takes neither GQA nor 3-d inputs: with enable_gqa it falls back to the
        # unfused math path (3.4x slower on a 64-token prompt of the bundled model), so repeat the KV heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [H, end, D]
    qh, k, v = q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # [1, H, n | end, D]
    if chunk.start_pos == 0:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale)
    else:
        # query i sits at position start_pos + i and sees keys up to and including it
        mask = torch.ones(chunk.num_tokens, end, dtype=torch.bool, device=q.device).tril(chunk.start_pos)
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)  # [n, H, D]
