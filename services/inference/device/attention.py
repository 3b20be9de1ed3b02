"""The paged KV cache and the attention over it.

Layout: k, v [layers, blocks + 1, kv_heads, block_size, head_dim]. A sequence's position p lives in block
`table[p // block_size]` at offset `p % block_size`, where `table` is its block table (sched/blocks.py hands
the blocks out). The extra last block is scratch that padded rows of a batch bucket write into, so they never
touch a live sequence. Both tensors are allocated once and never reallocated while serving.
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
    start_pos: int  # tokens [0, start_pos) of this sequence are already in the cache


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset where each token's k/v is written
    positions: torch.Tensor  # [T] int64
    num_decode: int  # rows [0, num_decode) are decode tokens, one per sequence
    block_tables: torch.Tensor  # [T, M] int64: each row's sequence's block table (rows of a chunk repeat it)
    decode_lens: torch.Tensor  # [num_decode] int64: context length including the new token
    max_decode_len: int  # attend over cache positions [0, max_decode_len) for decode rows
    prefills: tuple[PrefillChunk, ...] = ()

    @property
    def decode_tables(self) -> torch.Tensor:
        return self.block_tables[: self.num_decode]  # [num_decode, M]

    @staticmethod
    def prefill(table: torch.Tensor, block_size: int, start_pos: int, num_tokens: int) -> AttentionMetadata:
        """One sequence's prompt chunk alone in a step: positions [start_pos, start_pos + num_tokens), its blocks
        table [M] int64 (on the step's device)."""
        positions = torch.arange(start_pos, start_pos + num_tokens, device=table.device)
        empty = torch.empty(0, dtype=torch.int64, device=table.device)
        return AttentionMetadata(
            slot_mapping=table[positions // block_size] * block_size + positions % block_size,
            positions=positions,
            num_decode=0,
            block_tables=table.expand(num_tokens, -1),
            decode_lens=empty,
            max_decode_len=0,
            prefills=(PrefillChunk(0, num_tokens, start_pos),),
        )


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_blocks + 1, num_kv_heads, block_size, head_dim)
        # zeros, not empty: a padded or masked read must never meet a NaN (0 x NaN is NaN in the softmax's sum)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # per-layer views [blocks + 1, KVH, block_size, D], made once: selecting a layer costs a dispatch
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * block_size * head_dim * dtype.itemsize


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
        kc, vc = self.cache.k_layers[layer], self.cache.v_layers[layer]  # [blocks + 1, KVH, block_size, D]
        blocks, offsets = meta.slot_mapping // self.cache.block_size, meta.slot_mapping % self.cache.block_size
        kc[blocks, :, offsets] = k
        vc[blocks, :, offsets] = v
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
            out[rows] = _prefill(q[rows], kc, vc, meta.block_tables[chunk.token_offset], chunk, scale)
        return out

    def _decode(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.decode_kernel is not None:
            return self.decode_kernel(q, kc, vc, meta.decode_tables, meta.decode_lens, scale)
        return _decode_sdpa(q, kc, vc, scale, meta)


def gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """cache [blocks + 1, KVH, BS, D], table [..., M] -> [..., KVH, length, D]: positions [0, length) in order."""
    bs = cache.shape[2]
    blocks = cache[table[..., : -(-length // bs)]]  # [..., m, KVH, BS, D]
    kv_heads, d = cache.shape[1], cache.shape[3]
    rows = blocks.transpose(-4, -3).reshape(*table.shape[:-1], kv_heads, -1, d)  # [..., KVH, m * BS, D]
    return rows[..., :length, :]


def _decode_sdpa(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float, meta: AttentionMetadata
) -> torch.Tensor:
    # q [B, H, D]; gathers [B, KVH, L, D] with L = max_decode_len and masks each row past its length.
    n = meta.max_decode_len
    k, v = gather(kc, meta.decode_tables, n), gather(vc, meta.decode_tables, n)
    mask = torch.arange(n, device=q.device)[None, :] < meta.decode_lens[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )  # [B, H, 1, D]
    return out.squeeze(2)


def _prefill(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, chunk: PrefillChunk, scale: float
) -> torch.Tensor:
    # q [n, H, D] attends causally to cache positions [0, start_pos + n) of its sequence (table [M]).
    end = chunk.start_pos + chunk.num_tokens
    k, v = gather(kc, table, end), gather(vc, table, end)  # [KVH, end, D]
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
