"""Turns a step's logits into tokens.

Randomness is a pure function of (request seed, index of the token being drawn): one uniform number drawn
by inverse CDF. A request's tokens therefore do not depend on which other requests share its batch.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from .request import SamplingParams


def uniform(seed: int, index: int) -> float:
    """A reproducible number in [0, 1) for the `index`-th token drawn under `seed`."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [V] fp32 -> (probs [K], token ids [K]) in descending order after top-k and top-p."""
    scaled = logits / params.temperature
    k = params.top_k if 0 < params.top_k < scaled.shape[0] else scaled.shape[0]
    values, ids = torch.topk(scaled, k)                     # sorted descending
    probs = torch.softmax(values, dim=-1)
    if params.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        before = torch.cumsum(probs, dim=-1) - probs
        keep = int((before < params.top_p).sum())
        probs, ids = probs[:keep], ids[:keep]
    return probs, ids


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], draw_index: Sequence[int]) -> list[int]:
    """logits [N, V] fp32 -> one token per row; row i draws its draw_index[i]-th random number."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        probs, ids = _filtered_probs(logits[row], p)
        cdf = torch.cumsum(probs, dim=-1)
        target = uniform(p.seed, draw_index[row]) * float(cdf[-1])
        pick = min(int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True)), len(ids) - 1)
        tokens[row] = int(ids[pick])
    return tokens
