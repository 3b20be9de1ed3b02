"""Predicts how long an engine step takes, calibrated on this machine and corrected online. No torch here.

A step costs T(rows) + context_tokens * us_per_context_token, where rows is the number of token rows the
linear layers see (one per decoding request plus every prompt token of the step's chunks) and
context_tokens the cache positions that decode attention reads. T is piecewise linear through the
calibration points. Every measured step then updates a running ratio measured/predicted and its mean
absolute deviation; predictions are inflated by `num_deviations` of it (of a run of k steps: √k step
deviations), so a noisy machine is planned for rather than hoped away. One step counts as at most
MAX_STEP_JUMP times the running ratio: a real slowdown is a run of slow steps and still moves the ratio as far
as it goes, but one stalled step (the host preempted for a second) must not inflate every prediction so far
that every call is refused as infeasible; nothing would then run, and no step could bring the ratio back.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

MAX_STEP_JUMP = 4.0


@dataclass
class CostModel:
    rows: list[int]  # calibration points, ascending
    row_us: list[float]  # step time at each point, context excluded
    us_per_context_token: float
    # a row's host work beyond the calibrated (greedy, free) step: its grammar's mask, its log-probabilities
    us_per_masked_row: float = 0.0
    us_per_logprob_row: float = 0.0
    # a prompt row prefilled after a cached prefix reads that prefix too: µs per (prefilled row × cached position)
    us_per_prefill_context_token: float = 0.0
    alpha: float = 0.05  # weight of the newest step in the running ratio
    num_deviations: float = 3.0
    ratio: float = 1.0
    deviation: float = 0.05
    num_observed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # calibrated time by row count: admission asks for the same few counts thousands of times a second
    _base_us: dict[int, float] = field(default_factory=dict, repr=False, compare=False)
    # calibrated extra time of a prompt's chunks by (rows, prompt rows, chunk rows, free rows), likewise
    _chunks_us: dict[tuple[int, int, int, int], float] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.row_us) or self.rows != sorted(set(self.rows)):
            raise ValueError("rows must be ascending and match row_us")

    def raw_step_us(self, num_rows: int, context_tokens: int = 0) -> float:
        """Calibrated step time, before the online correction."""
        base = self._base_us.get(num_rows)
        if base is None:
            base = self._base_us[num_rows] = self._interpolate(num_rows)
        return base + context_tokens * self.us_per_context_token

    def _interpolate(self, num_rows: int) -> float:
        i = bisect.bisect_left(self.rows, num_rows)
        if i < len(self.rows) and self.rows[i] == num_rows:
            base = self.row_us[i]
        elif len(self.rows) == 1:
            base = self.row_us[0] * max(num_rows, 1) / max(self.rows[0], 1)
        else:
            lo = min(max(i - 1, 0), len(self.rows) - 2)  # extrapolate with the nearest segment
            slope = (self.row_us[lo + 1] - self.row_us[lo]) / (self.rows[lo + 1] - self.rows[lo])
            base = self.row_us[lo] + slope * (num_rows - self.rows[lo])
        return max(base, self.row_us[0] * 0.5)

    def host_us(self, num_masked_rows: int, num_logprob_rows: int) -> float:
        """Calibrated host time the rows add to a step beyond its calibrated time: those under a grammar's mask,
        those reporting log-probabilities (a call's own row: 1 or 0 of each)."""
        return num_masked_rows * self.us_per_masked_row + num_logprob_rows * self.us_per_logprob_row

    def step_us(self, num_rows: int, context_tokens: int = 0) -> float:
        """A cautious prediction of one step: calibrated time × (running ratio + num_deviations × deviation)."""
        return self.raw_step_us(num_rows, context_tokens) * (self.ratio + self.num_deviations * self.deviation)

    def steps_us(self, num_steps: int, num_rows: int, context_tokens: int = 0) -> tuple[float, float]:
        """`num_steps` steps of one shape: (expected time, variance), in µs and µs². Step noise adds up like
        independent noise, so k steps spread by √k deviations, not k: a prediction over many steps that is
        inflated per step would refuse calls that fit."""
        raw = self.raw_step_us(num_rows, context_tokens)
        return num_steps * raw * self.ratio, num_steps * (raw * self.deviation) ** 2

    def prefill_us(self, num_rows: int, num_tokens: int, chunk_rows: int, free_rows: int = 0) -> float:
        """Cautious extra time of `num_tokens` prompt rows prefilled in chunks of at most `chunk_rows`, each in a
        step of `num_rows` other rows whose first `free_rows` prompt rows cost nothing more (a paced step is padded
        to them): a chunk of c rows adds T(num_rows + max(c, free_rows)) - T(num_rows + free_rows). Priced by the
        chunk, not by the marginal row of the small batch: the calibration is not a line, and a 256-row chunk costs
        more a row than the second row of a step does on a CPU (compute-bound), less on a GPU."""
        key = (num_rows, num_tokens, chunk_rows, free_rows)
        extra_us = self._chunks_us.get(key)
        if extra_us is None:  # calibrated, so kept: admission asks for the same few prompts many times a decision
            if len(self._chunks_us) >= 4096:
                self._chunks_us.clear()
            extra_us = self._chunks_us[key] = self._raw_chunks_us(*key)
        return extra_us * (self.ratio + self.num_deviations * self.deviation)

    def _raw_chunks_us(self, num_rows: int, num_tokens: int, chunk_rows: int, free_rows: int) -> float:
        if num_tokens <= 0:
            return 0.0
        chunk_rows = max(chunk_rows, 1)
        num_full, last = divmod(num_tokens, chunk_rows)
        raw = self.raw_step_us
        base_us = raw(num_rows + free_rows)
        extra_us = num_full * max(raw(num_rows + max(chunk_rows, free_rows)) - base_us, 0.0)
        return extra_us + (max(raw(num_rows + max(last, free_rows)) - base_us, 0.0) if last else 0.0)

    def observe(self, num_rows: int, context_tokens: int, measured_us: int, extra_us: float = 0.0) -> float:
        """A measured step; `extra_us` is the calibrated host time of its masked and log-probability rows. Returns
        the step's own measured / calibrated time, before the running ratio's cap (1.0 if nothing was calibrated)."""
        raw = self.raw_step_us(num_rows, context_tokens) + extra_us
        if raw <= 0:
            return 1.0
        with self._lock:
            ratio = min(measured_us / raw, self.ratio * MAX_STEP_JUMP)
            self.num_observed += 1
            self.ratio += self.alpha * (ratio - self.ratio)
            self.deviation += self.alpha * (abs(ratio - self.ratio) - self.deviation)
        return measured_us / raw

    def follow(self, ratio: float) -> None:
        """The device runs `ratio` times its calibrated speed, as its watchdog measured over its last steps:
        predictions take that at once rather than over the running ratio's dozens of steps."""
        with self._lock:
            self.ratio = max(self.ratio, ratio)

    def settle(self, ratio: float) -> None:
        """The device is back to `ratio` times its calibrated speed, as its watchdog measured on recovery:
        predictions drop to it at once rather than over the dozens of steps the running ratio takes to decay
        from a slowdown (a replica that has recovered must not go on refusing what it can serve)."""
        with self._lock:
            self.ratio = min(self.ratio, ratio)

    def to_dict(self) -> dict:
        return {
            "rows": self.rows,
            "row_us": [round(u, 1) for u in self.row_us],
            "us_per_context_token": self.us_per_context_token,
            "us_per_masked_row": round(self.us_per_masked_row, 1),
            "us_per_logprob_row": round(self.us_per_logprob_row, 1),
            "us_per_prefill_context_token": round(self.us_per_prefill_context_token, 6),
            "ratio": round(self.ratio, 4),
            "deviation": round(self.deviation, 4),
            "num_observed": self.num_observed,
        }


def fit_context_cost(short_ctx: int, short_us: float, long_ctx: int, long_us: float) -> float:
    """µs per cached position read by attention, from two runs that differ only in the positions read."""
    if long_ctx <= short_ctx:
        return 0.0
    return max((long_us - short_us) / (long_ctx - short_ctx), 0.0)
