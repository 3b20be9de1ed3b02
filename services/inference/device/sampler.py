"""Turns a step's logits into tokens.

Randomness is a pure function of (request seed, index of the token being drawn): one uniform number drawn
by inverse CDF. A request's tokens therefore do not depend on which other requests share its batch.

Whatever the device, the device computes the argmax and picks out the rows to sample, one copy brings them to
the host, and every draw is made there on fp32: one host sync per step, and the same logits draw the same
token on a CPU and on a GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from ..sched.request import SamplingParams

_FIRST_NUCLEUS_K = 256


def uniform(seed: int, index: int) -> float:
    """A reproducible number in [0, 1) for the `index`-th token drawn under `seed`."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def filtered_probs(scaled: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
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
    keep = max(1, int((before < top_p).sum()))
    return probs[:keep], ids[:keep]


def to_host(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """logits [N, V] fp32 on the step's device -> (argmax [N] on the host, the rows to sample, their logits
    [len(rows), V] on the host, or None when every row is greedy). The only part that touches the device."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    argmax = torch.argmax(logits, dim=-1)
    if not rows:
        return argmax.cpu(), rows, None
    argmax = argmax.to("cpu", non_blocking=True)
    picked = logits if len(rows) == len(params) else logits.index_select(0, torch.tensor(rows).to(logits.device))
    # a blocking copy on the same stream: once it is back, the argmax copy queued before it is back too
    return argmax, rows, picked.to("cpu")


def draw(scaled: torch.Tensor, params: SamplingParams, index: int) -> int:
    """Temperature-scaled logits [V] fp32 on the host -> the token drawn by the index-th number of the seed."""
    if not 0 < params.top_k < scaled.shape[0] and params.top_p >= 1.0:  # no filter: vocabulary order, no sort
        probs, ids = torch.softmax(scaled, dim=-1), None
    else:
        probs, ids = filtered_probs(scaled, params)
    cdf = torch.cumsum(probs, dim=-1)
    target = uniform(params.seed, index) * float(cdf[-1])
    pick = min(int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True)), len(cdf) - 1)
    return pick if ids is None else int(ids[pick])


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], draw_index: Sequence[int]) -> list[int]:
    """logits [N, V] fp32 on any device -> one token per row; row i draws its draw_index[i]-th random number."""
    argmax, rows, host = to_host(logits, params)
    tokens = argmax.tolist()
    for k, row in enumerate(rows):
        p = params[row]
        scaled = host[k] / p.temperature
        # a temperature so small that the scaled logits overflow draws the argmax, which is what it tends to
        # (and what softmax of infinities, NaN, cannot draw)
        if bool(torch.isfinite(scaled).all()):
            tokens[row] = draw(scaled, p, draw_index[row])
    return tokens
