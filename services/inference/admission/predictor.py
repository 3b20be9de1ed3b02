"""When admitted calls finish: the prediction over the cost model, and the running calls as a prediction from a later
time must see them.

The prediction behind admission: when each commitment finishes if all run from now. A prediction walks the
commitments in order of how many steps each still needs: between two finishes the batch is constant, so each
phase costs its number of steps × the step time at that batch size, and a call's finish is the expected time of
all phases up to its own plus `num_deviations` of their combined spread. Pending prompt tokens add their
marginal cost to everyone. No torch.

The running calls and reserved retries as a prediction at a later time must see them. No torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from operator import itemgetter

from ..cost.model import CostModel
from .decisions import AdmissionConfig, Commitment


def _steps_left(num_remaining_tokens: int, num_prefill_tokens: int, budget: int) -> int:
    """One step per token still to generate; a prompt longer than the step's token budget needs extra chunk
    steps before its first token."""
    return num_remaining_tokens + max(-(-num_prefill_tokens // budget) - 1, 0)


def _finish_ns(now_ns: int, mean_us: float, var_us2: float, num_deviations: float) -> int:
    return now_ns + int((mean_us + num_deviations * math.sqrt(var_us2)) * 1000)


def peak_occupancy(intervals: list[tuple[int, int]], start: int, end: int) -> int:
    """The most half-open intervals [s, e) open at once at any instant of [start, end)."""
    open_at_start, events = 0, []
    for s, e in intervals:
        if e <= start or s >= end:
            continue
        if s <= start:
            open_at_start += 1
        else:
            events.append((s, 1))
        if e < end:
            events.append((e, -1))
    peak = current = open_at_start
    for _, delta in sorted(events):  # at a tie an interval ends before another starts
        current += delta
        peak = max(peak, current)
    return peak


def _prefill_reads(num_prefill: int, num_cached: int, budget: int) -> int:
    """Cache positions the rows of a prompt's prefill read beyond those of a cold chunk of its size: every row
    reads the cached prefix, and a chunk after the first (a prompt longer than the step budget) the chunks before
    it too. A cold chunk's reads of itself are in the calibrated step."""
    reads, start = num_prefill * num_cached, budget
    while start < num_prefill:
        reads += min(budget, num_prefill - start) * start
        start += budget
    return reads


class Predictor:
    def __init__(self, cost: CostModel, config: AdmissionConfig, max_batch: int | None = None) -> None:
        self.cost = cost
        self.config = config
        self._max_batch = max_batch or 2 * config.num_slots + 1  # most commitments in one prediction
        self._cheapest_us: float | None = None
        # the engine's step in flight (`step_in_flight`, set before each decision): when it ends (engine clock;
        # 0: none), and the prompt rows it runs by call; nothing decided before its end joins a step
        self.step_end_ns: int = 0
        self.in_flight_rows: dict[str, int] = {}

    def finish_times(self, commitments: list[Commitment], now_ns: int) -> dict[str, int]:
        """Predicted finish (engine clock) of every commitment if all run from now and nothing else joins."""
        if not commitments:
            return {}
        # Runs on every decision, several times on a refusal: one pass over plain tuples, no properties, no
        # calls per commitment (the step count is _steps_left's, inline); a finish per phase, not per call.
        budget, pace, cost = self.config.max_num_batched_tokens, self.config.pace_tokens, self.cost
        prefill_tokens, prefills, cached_reads, context_left, extra_left, num_decoding, order = 0, [], 0, 0, 0.0, 0, []
        masked_us, logprob_us = cost.us_per_masked_row, cost.us_per_logprob_row
        # a step in flight comes first: it brings a token to every decoding call, runs a chunk of the prompts
        # that joined before it, and the first token of those it ends
        in_flight, chunks = self.step_end_ns > now_ns, self.in_flight_rows
        for c in commitments:
            generated, prompt, max_tokens = c.num_generated, c.num_prompt_tokens, c.max_tokens
            remaining = max_tokens - generated if max_tokens > generated else 0
            if generated:
                num_decoding += 1
                remaining -= 1 if in_flight and remaining else 0
            else:
                prefill = prompt - c.num_cached_tokens  # the cached prefix is read, never computed
                if in_flight and (ran := chunks.get(c.key, 0)):
                    prefill = max(prefill - ran, 0)
                    remaining -= 1 if prefill == 0 and remaining else 0
                prefill_tokens += prefill
                if prefill > 1:  # its last row is its row of the step, counted in n
                    prefills.append(prefill - 1)
                cached_reads += _prefill_reads(prefill, c.num_cached_tokens, budget)
                if prefill > budget:
                    remaining += (prefill - 1) // budget  # chunk steps before the first token
            context_left += prompt + max_tokens
            extra = c.masked * masked_us + c.logprobs * logprob_us  # its row's host work, every step
            extra_left += extra
            order.append((remaining, prompt + max_tokens, c.key, extra))
        order.sort(key=itemgetter(0))
        n = len(order)
        # each prompt in chunks of its own, of what the step budget leaves the decoding rows, or at the marginal row
        # of the batch, whichever is more: the step time is not a line in its rows, and a chunk costs more a row
        # than the batch's next row where the calibration bends up (a long prompt on a CPU), less where it bends
        # down, where the marginal row keeps the slack that calls joining meanwhile take. Paced, a step costs at
        # least as much as with `pace` prompt tokens: those come at no extra cost
        mean_us, chunk_rows = 0.0, budget - num_decoding
        for p in prefills:
            mean_us += cost.prefill_us(n, p, chunk_rows, pace)
        mean_us += (self.step_end_ns - now_ns) / 1000 if in_flight else 0.0
        mean_us += cached_reads * cost.us_per_prefill_context_token * cost.ratio
        finish, var_us2, done_steps, k, steps_us = {}, 0.0, 0, cost.num_deviations, cost.steps_us
        finish_ns = _finish_ns(now_ns, mean_us, var_us2, k)
        for i, (steps, final_context, key, extra) in enumerate(order):
            if steps > done_steps:
                phase_us, phase_var = steps_us(steps - done_steps, n - i + pace, context_left)
                phase_us += (steps - done_steps) * extra_left * cost.ratio if extra_left else 0.0
                mean_us, var_us2, done_steps = mean_us + phase_us, var_us2 + phase_var, steps
                finish_ns = _finish_ns(now_ns, mean_us, var_us2, k)
            finish[key] = finish_ns
            context_left -= final_context
            extra_left -= extra
        return finish

    def earliest_finish(self, c: Commitment, now_ns: int) -> int:
        """A floor under `c`'s predicted finish from now, however many share its steps: as many steps as
        alone, each at the cheapest step time of any batch it could be part of, with no context but its own
        (finish_times never predicts less: every phase up to its finish is at least that)."""
        cost = self.cost
        steps = _steps_left(c.num_remaining_tokens, c.num_prefill_tokens, self.config.max_num_batched_tokens)
        raw_us = (
            self._cheapest_step_us() + c.final_context * cost.us_per_context_token + cost.host_us(c.masked, c.logprobs)
        )
        mean_us, var_us2 = steps * raw_us * cost.ratio, steps * (raw_us * cost.deviation) ** 2
        return _finish_ns(now_ns, mean_us, var_us2, cost.num_deviations)

    def _cheapest_step_us(self) -> float:
        """The least calibrated step time over every batch a prediction can see (1 to all commitments, plus
        the pace rows): the step time of the smallest batch when the calibration rises with the rows."""
        if self._cheapest_us is None:
            pace = self.config.pace_tokens
            self._cheapest_us = min(self.cost.raw_step_us(n + pace) for n in range(1, self._max_batch + 1))
        return self._cheapest_us

    def meets_deadlines(
        self, commitments: list[Commitment], new: Commitment, at_ns: int, before: dict[str, int]
    ) -> tuple[bool, int]:
        """Whether `new`, joining at `at_ns`, meets its deadline and pushes no commitment past a deadline it
        was predicted to meet; also `new`'s predicted finish."""
        after = self.finish_times([*commitments, new], at_ns)
        if after[new.key] > new.deadline_ns - self.margin_for(new, at_ns):
            return False, after[new.key]
        for c in commitments:
            limit, was = c.deadline_ns - self.margin_for(c, at_ns), before.get(c.key, 0)
            # a call predicted past its limit is not pushed any later: neither one the safety margin still covers nor
            # one already predicted past its deadline. The prediction is cautious, so such a call may still make it;
            # but left unguarded, each admission after it pushed it further: with --hold (a call held for a later
            # start is predicted over the replica the calendar expected then, emptier than the one it meets), 12 of
            # 59,394 admitted calls missed so on the virtual replica (BENCHMARKS.md "Held calls that keep their
            # promises"), and with the engine starting waiting calls by deadline, the default too (2 calls of a 20-s
            # run at 4x with retries: test_burst_prompts.py)
            if after[c.key] > limit and (was <= limit or after[c.key] > was):
                return False, after[new.key]
        return True, after[new.key]

    def margin_for(self, c: Commitment, now_ns: int) -> int:
        return self.config.margin_ns(max(c.deadline_ns - now_ns, 0))


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
                masked=c.masked,
                logprobs=c.logprobs,
                num_cached_tokens=c.num_cached_tokens,
                num_blocks=c.num_blocks,
            )
        )
    return later


def step_in_flight(
    predictor: Predictor, commitments: Iterable[Commitment], began_ns: int, now_ns: int
) -> tuple[int, dict[str, int]]:
    """The step the engine runs now, begun at `began_ns`: when it ends (0: none runs), and the prompt rows it runs
    by call. Its rows: a token of every decoding call, then the prompts that joined before it began (held calls
    past their start too), in order, in the chunk the step budget leaves them; its time is cautious, as every
    step's. What it brings the calls in it is not counted again (`Predictor.finish_times`)."""
    num_decoding, context, pending = 0, 0, []
    for c in commitments:
        if c.reserved_from_ns is not None and not (c.held and c.reserved_from_ns <= now_ns):
            continue  # a reservation, or a held call before its start: not the engine's yet
        generated = c.num_generated
        context += c.num_prompt_tokens + generated
        if generated:
            num_decoding += 1
        elif c.admitted_ns <= began_ns:
            pending.append(c)
    room, rows = max(predictor.config.max_num_batched_tokens - num_decoding, 0), {}
    for c in pending:
        if room <= 0:
            break
        rows[c.key] = min(c.num_prompt_tokens - c.num_cached_tokens, room)
        room -= rows[c.key]
    num_rows = num_decoding + sum(rows.values())
    if num_rows == 0:
        return 0, rows
    return began_ns + int(predictor.cost.step_us(num_rows, context) * 1000), rows


def from_their_time(predictor: Predictor, due: list[Commitment], at_ns: int, num_rows: int) -> list[Commitment]:
    """Reserved retries as the prediction from `at_ns` must see them: it runs every commitment from then, but
    a retry joins at its reserved time, so it shares the steps of calls that run past its predicted finish
    from now. Each is counted as running from now with a step more for every step before it joins (at the
    expected, not the cautious, step time: more steps is the cautious side), its prompt from now."""
    step_ns = max(predictor.cost.raw_step_us(num_rows) * predictor.cost.ratio * 1000, 1.0)
    shifted = []
    for r in due:
        steps_before = int((r.reserved_from_ns - at_ns) // step_ns) if r.reserved_from_ns > at_ns else 0
        shifted.append(
            Commitment(
                r.key,
                r.num_prompt_tokens,
                r.max_tokens + steps_before,
                r.deadline_ns,
                masked=r.masked,
                logprobs=r.logprobs,
                num_cached_tokens=r.num_cached_tokens,
            )
        )
    return shifted


def steps_until_room(admitted: list[Commitment], budget: int) -> int:
    """Steps before the engine's step token budget has room for one more prompt: 0 when a call admitted
    now gets at least its first prompt chunk into the very next step. Every decoding call takes a token of
    each step first; prompts admitted but not yet begun are prefilled in order, in chunks. (A call whose
    prompt runs in the current step counts as pending until its first token comes back: cautious.)"""
    decoding = sum(1 for c in admitted if c.num_generated > 0)
    pending = sum(c.num_prefill_tokens for c in admitted if c.num_generated == 0)
    excess = decoding + pending - budget  # tokens ahead of the new call that the next step cannot take
    return 0 if excess < 0 else excess // max(budget - decoding, 1) + 1
