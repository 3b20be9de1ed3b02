"""Turns a step's logits into tokens.

Randomness is a pure function of (request seed, index of the token being drawn): one uniform number drawn
by inverse CDF. A request's tokens therefore do not depend on which other requests share its batch.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from .request import SamplingParams

_FIRST_NUCLEUS_K = 256


def uniform(seed: int, index: int) -> float:
    """A reproducible number in [0, 1) for the `index`-th token drawn under `seed`."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def _filtered_probs(scaled: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature-scaled logits [V] fp32 -> (probs [K], token ids [K]) in descending order after top-k and
    top-p, for a call that has either filter. The probabilities need not sum to one (the caller draws
    against their total)."""
    vocab_size = scaled.shape[0]
    if 0 < params.top_k < vocab_size:
        values, ids = torch.topk(scaled, params.top_k)
        probs = torch.softmax(values, dim=-1)
        if params.top_p < 1.0:
            probs, ids = _nucleus(probs, ids, params.top_p)
        return probs, ids
    # top-p alone: a full sort of the vocabulary costs ~6 ms per row at 49k tokens, while the nucleus of a
    # peaked distribution lies within the best few hundred: look there first, sort all only if it does not
    # end there. Probabilities are those of the whole vocabulary either way, so the nucleus is the same.
    log_z = torch.logsumexp(scaled, dim=-1)
    for k in dict.fromkeys((min(_FIRST_NUCLEUS_K, vocab_size), vocab_size)):
        values, ids = torch.topk(scaled, k)
        probs, kept = _nucleus(torch.exp(values - log_z), ids, params.top_p)
        if kept.shape[0] < k:
            break
    return probs, kept


def _nucleus(probs: torch.Tensor, ids: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest prefix of descending `probs` whose mass reaches top_p (always at least the top token)."""
    before = torch.cumsum(probs, dim=-1) - probs
    keep = int((before < top_p).sum())
    return probs[:keep], ids[:keep]


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], draw_index: Sequence[int]) -> list[int]:
    """logits [N, V] fp32 -> one token per row; row i draws its draw_index[i]-th random number."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        scaled = logits[row] / p.temperature
        if not 0 < p.top_k < scaled.shape[0] and p.top_p >= 1.0:    # no filter: draw in vocabulary order, no sort
            probs, ids = torch.softmax(scaled, dim=-1), None
        else:
            probs, ids = _filtered_probs(scaled, p)
        cdf = torch.cumsum(probs, dim=-1)
        target = uniform(p.seed, draw_index[row]) * float(cdf[-1])
        pick = min(int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True)), len(cdf) - 1)
        tokens[row] = pick if ids is None else int(ids[pick])
    return tokens
