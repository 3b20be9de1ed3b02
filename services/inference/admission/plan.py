"""The running calls and reserved retries as a prediction at a later time must see them. No torch."""

from __future__ import annotations

from .decisions import Commitment
from .predictor import Predictor


def progressed(admitted: list[Commitment], finishes: dict[str, int], now_ns: int, at_ns: int) -> list[Commitment]:
    """The running calls as they will be at `at_ns`: those finished by then gone, the others advanced in
    proportion to the time elapsed towards their predicted finish."""
    later = []
    for c in admitted:
        finish_ns = finishes[c.key]
        if finish_ns <= at_ns:
            continue
        # a plain copy: dataclasses.replace costs more than the prediction that follows
        generated, max_tokens = c.num_generated, c.max_tokens
        remaining = max_tokens - generated if max_tokens > generated else 0
        later.append(
            Commitment(
                c.key,
                c.num_prompt_tokens,
                max_tokens,
                c.deadline_ns,
                generated + remaining * (at_ns - now_ns) // max(finish_ns - now_ns, 1),
            )
        )
    return later


def from_their_time(predictor: Predictor, due: list[Commitment], at_ns: int, num_rows: int) -> list[Commitment]:
    """Reserved retries as the prediction from `at_ns` must see them: it runs every commitment from then, but
    a retry joins at its reserved time, so it shares the steps of calls that run past its predicted finish
    from now. Each is counted as running from now with a step more for every step before it joins (at the
    expected, not the cautious, step time: more steps is the cautious side), its prompt from now."""
    step_ns = max(predictor.cost.raw_step_us(num_rows) * predictor.cost.ratio * 1000, 1.0)
    shifted = []
    for r in due:
        steps_before = int((r.reserved_from_ns - at_ns) // step_ns) if r.reserved_from_ns > at_ns else 0
        shifted.append(Commitment(r.key, r.num_prompt_tokens, r.max_tokens + steps_before, r.deadline_ns))
    return shifted


def steps_until_room(admitted: list[Commitment], budget: int) -> int:
    """Steps before the engine's step token budget has room for one more prompt: 0 when a call admitted
    now gets at least its first prompt chunk into the very next step. Every decoding call takes a token of
    each step first; prompts admitted but not yet begun are prefilled in order, in chunks. (A call whose
    prompt runs in the current step counts as pending until its first token comes back: cautious.)"""
    decoding = sum(1 for c in admitted if c.num_generated > 0)
    pending = sum(c.num_prompt_tokens for c in admitted if c.num_generated == 0)
    excess = decoding + pending - budget  # tokens ahead of the new call that the next step cannot take
    return 0 if excess < 0 else excess // max(budget - decoding, 1) + 1
