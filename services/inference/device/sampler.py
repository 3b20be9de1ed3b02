"""Turns a step's logits into tokens.

Randomness is a pure function of (request seed, index of the token being drawn): one uniform number drawn
by inverse CDF. A request's tokens therefore do not depend on which other requests share its batch.

Whatever the device, the device computes the argmax and picks out the rows to draw on the host (sampled,
constrained or reporting log-probabilities), one copy brings them to the host, and every draw is made there on
fp32: one host sync per step, and the same logits draw the same token on a CPU and on a GPU.

A constrained row's grammar matcher (grammar.py, llguidance) writes the tokens it allows as a bitmask; the
disallowed logits become -inf before temperature, top-k, top-p and the draw, so every mode draws inside the
grammar, and the matcher takes the token drawn. Log-probabilities come from that same masked, scaled distribution.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ..sched.request import SamplingParams

if TYPE_CHECKING:
    from ..grammar import Matcher

# (the drawn token's log-probability, the top alternatives as (token id, log-probability), most likely first)
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]


# the CPU kernels' apply_token_bitmask: logits fp32 [C, V] in place, words int32 [C, W] -> argmax int64 [C]
MaskKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StepDraws(NamedTuple):
    tokens: list[int]  # one per row
    logprobs: dict[int, TokenLogprob]  # by row, for the rows that asked
    grammar_errors: dict[int, str]  # by row: the matcher failed (its limits); the row's token is meaningless


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
    """logits [N, V] fp32 on the step's device -> (argmax [N] on the host, the rows to draw on the host, their
    logits [len(rows), V] on the host, or None when every row is greedy and plain). The only part that touches
    the device."""
    rows = [i for i, p in enumerate(params) if p.on_host]
    if len(rows) == len(params):  # every row drawn on the host: no argmax here (the host's comes after any mask)
        return torch.zeros(len(params), dtype=torch.int64), rows, logits.to("cpu")
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
    return draw_step(logits, params, draw_index).tokens


def draw_step(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    draw_index: Sequence[int],
    matchers: Sequence[Matcher | None] | None = None,
    apply_mask: MaskKernel | None = None,
) -> StepDraws:
    """logits [N, V] fp32 on any device -> one token per row, row i drawing its draw_index[i]-th random number
    under its grammar matcher (matchers[i], None for a free row), which then takes the token; and the
    log-probabilities of the rows that asked for them. What can be done for all host rows at once is (the masks,
    the masked argmax, the scaling, the log-softmax): at a 49k vocabulary a call per row costs more than the row."""
    argmax, rows, host = to_host(logits, params)
    tokens, errors = argmax.tolist(), {}
    if host is None:
        return StepDraws(tokens, {}, errors)
    row_params = [params[row] for row in rows]
    row_matchers = [matchers[row] for row in rows] if matchers is not None else [None] * len(rows)
    failed, best = mask(host, row_matchers, apply_mask) if matchers is not None else ({}, {})
    # the host rows' argmax (after their masks), by row: a constrained greedy row's token (the kernel's, found as it
    # masked), or any row's when the device computed none (every row on the host)
    every_row = len(rows) == len(params)
    missing = [k for k, m in enumerate(row_matchers) if k not in best and (m is not None or every_row)]
    if missing:
        found = host.argmax(dim=1) if len(missing) == len(rows) else host[missing].argmax(dim=1)
        best.update(zip(missing, found.tolist()))
    # each row divided by its temperature (a greedy row's logits as they are): the distribution it is drawn from
    scaled = host
    if any(p.temperature not in (0.0, 1.0) for p in row_params):  # dividing by 1 changes nothing: no copy
        scaled = host / torch.tensor([[p.temperature or 1.0] for p in row_params])
    for k, (row, p, matcher) in enumerate(zip(rows, row_params, row_matchers)):
        if k in failed:
            errors[row] = failed[k]
        elif p.greedy:
            tokens[row] = best.get(k, tokens[row])
        elif _drawable(scaled[k], matcher is not None):
            tokens[row] = draw(scaled[k], p, draw_index[row])
        else:
            # a temperature so small that the scaled logits overflow draws the argmax, which is what it tends to
            # (and what softmax of infinities, NaN, cannot draw)
            tokens[row] = best[k] if k in best else int(torch.argmax(host[k]))
    asked = [k for k, p in enumerate(row_params) if p.logprobs and k not in failed]
    logprobs = _logprobs(scaled, asked, [tokens[rows[k]] for k in asked], [row_params[k].top_logprobs for k in asked])
    for k, matcher in enumerate(row_matchers):
        row = rows[k]
        if matcher is not None and k not in failed and not matcher.consume(tokens[row]):
            errors[row] = matcher.error or f"the grammar refused token {tokens[row]}"
    return StepDraws(tokens, {rows[k]: lp for k, lp in logprobs.items()}, errors)


def _logprobs(scaled: torch.Tensor, asked: list[int], chosen: list[int], tops: list[int]) -> dict[int, TokenLogprob]:
    """The log-probabilities of rows `asked` of scaled logits [N, V] fp32: of each row's chosen token and its
    `tops` most likely, over the whole vocabulary (a masked token is -inf: probability 0), all rows at once."""
    if not asked:
        return {}
    # (torch's log_softmax takes half the time of its logsumexp on this CPU, 0.9 against 2.1 ms at [32, 49k])
    logp = torch.log_softmax(scaled[asked] if len(asked) < scaled.shape[0] else scaled, dim=-1)  # [A, V]
    picked = logp.gather(1, torch.tensor(chosen).unsqueeze(1)).squeeze(1).tolist()
    most = max(tops)
    values, ids = torch.topk(logp, min(most, logp.shape[1])) if most else (None, None)
    out = {}
    for i, k in enumerate(asked):
        alternatives: tuple[tuple[int, float], ...] = ()
        if tops[i]:
            pairs = zip(ids[i, : tops[i]].tolist(), values[i, : tops[i]].tolist())
            alternatives = tuple((t, v) for t, v in pairs if v != float("-inf"))
        out[k] = (picked[i], alternatives)
    return out


def _drawable(scaled: torch.Tensor, masked: bool) -> bool:
    """No logit overflowed to +inf or NaN (a mask's -inf is a probability of 0, not an overflow)."""
    if not masked:
        return bool(torch.isfinite(scaled).all())
    return math.isfinite(float(scaled.max()))  # max is NaN if any is, +inf if any is, finite if some token is allowed


def mask(
    host: torch.Tensor, matchers: Sequence[Matcher | None], apply_mask: MaskKernel | None = None
) -> tuple[dict[int, str], dict[int, int]]:
    """Sets the logits [N, V] fp32 on the host of every row with a matcher to -inf wherever its grammar does not allow
    the token next, all rows at once (with `apply_mask`, the CPU kernels' one pass; else numpy's bits and a masked
    fill). Returns the rows whose matcher failed (its per-token limits) or allows nothing, with why; and, from the
    kernel, each masked row's argmax (else none). (The logits are the step's own, used for nothing after the draw:
    masked in place.)"""
    constrained = [(k, m) for k, m in enumerate(matchers) if m is not None]
    if not constrained:
        return {}, {}
    num_words = (constrained[0][1].vocab_size + 31) // 32  # one tokenizer: one mask size
    words = torch.empty((len(constrained), num_words), dtype=torch.int32)
    row_bytes, base = num_words * 4, words.data_ptr()
    failed = {}
    for i, (k, matcher) in enumerate(constrained):
        matcher.fill_mask(base + i * row_bytes, row_bytes)
        if matcher.error:
            failed[k] = matcher.error
    bits = words.numpy()
    for i in np.flatnonzero(~bits.any(axis=1)).tolist():
        failed.setdefault(constrained[i][0], "the grammar allows no token")
    if apply_mask is not None:
        rows = [k for k, _ in constrained]
        return failed, dict(zip(rows, _apply_with(apply_mask, host, words, rows)))
    # bit j of word w allows token 32 w + j: [C, W] int32 -> [C, 32 W] bits of the words inverted (1: banned), as
    # bools without a copy; model rows past the tokenizer's vocabulary (no text) are banned too
    banned = torch.from_numpy(np.unpackbits((~bits).view(np.uint8), axis=1, bitorder="little")).view(torch.bool)
    vocab = host.shape[1]
    if banned.shape[1] >= vocab:
        banned = banned[:, :vocab]
    else:
        banned = torch.cat((banned, torch.ones(len(constrained), vocab - banned.shape[1], dtype=torch.bool)), 1)
    if len(constrained) == host.shape[0]:  # every row: no gather and scatter
        host.masked_fill_(banned, float("-inf"))
    else:
        index = torch.tensor([k for k, _ in constrained])
        host[index] = host[index].masked_fill_(banned, float("-inf"))
    return failed, {}


def _apply_with(apply_mask: MaskKernel, host: torch.Tensor, words: torch.Tensor, rows: list[int]) -> list[int]:
    """The kernel on the constrained rows of host [N, V] (in place when they are all of them, else on their copy):
    their argmax after the masks."""
    if len(rows) == host.shape[0] and host.is_contiguous():
        return apply_mask(host, words).tolist()
    index = torch.tensor(rows)
    picked = host.index_select(0, index)
    argmax = apply_mask(picked, words).tolist()
    host.index_copy_(0, index, picked)
    return argmax
