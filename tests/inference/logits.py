"""Runs the model directly over a prompt, in chunks, returning the logits of every position."""

from __future__ import annotations

import torch

from services.inference.device.attention import AttentionMetadata, PrefillChunk
from services.inference.device.executor import Executor


@torch.inference_mode()
def prompt_logits(executor: Executor, tokens: list[int], chunk_size: int | None = None, slot: int = 0) -> torch.Tensor:
    """tokens [T] -> logits [T, vocab], prefilling `chunk_size` tokens at a time into `slot`."""
    chunk_size = chunk_size or len(tokens)
    empty = torch.empty(0, dtype=torch.int64)
    out = []
    for start in range(0, len(tokens), chunk_size):
        n = min(chunk_size, len(tokens) - start)
        positions = torch.arange(start, start + n)
        meta = AttentionMetadata(
            slot_ids=torch.full((n,), slot),
            positions=positions,
            num_decode=0,
            decode_slots=empty,
            decode_lens=empty,
            max_decode_len=0,
            prefills=(PrefillChunk(0, n, slot, start),),
        )
        out.append(
            executor.model(torch.tensor(tokens[start : start + n]), positions, torch.arange(n), executor.backend, meta)
        )
    return torch.cat(out)
