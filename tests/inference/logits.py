"""Runs the model directly over a prompt, in chunks, returning the logits of every position."""

from __future__ import annotations

import torch

from services.inference.device.attention import AttentionMetadata
from services.inference.device.executor import Executor


@torch.inference_mode()
def prompt_logits(
    executor: Executor, tokens: list[int], chunk_size: int | None = None, first_block: int = 0
) -> torch.Tensor:
    """tokens [T] -> logits [T, vocab], prefilling `chunk_size` tokens at a time into consecutive blocks from
    `first_block` on."""
    chunk_size = chunk_size or len(tokens)
    bs = executor.kv_cache.block_size
    table = torch.arange(first_block, first_block + -(-len(tokens) // bs))
    out = []
    for start in range(0, len(tokens), chunk_size):
        n = min(chunk_size, len(tokens) - start)
        meta = AttentionMetadata.prefill(table, bs, start, n)
        tokens_in = torch.tensor(tokens[start : start + n])
        out.append(executor.model(tokens_in, meta.positions, torch.arange(n), executor.backend, meta))
    return torch.cat(out)
