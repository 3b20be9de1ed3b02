"""Paced steps: the engine steps on a cadence, so a call's latency does not depend on who arrives. No torch.

Unpaced, a decode step of the bundled model takes ~0.3 ms and a step that also fills a 64-token prompt ~2.8 ms,
so every arrival during a call's life adds a long step to it: at half the capacity the 99th-percentile call
meets four or five arrivals and the median one, none, and P99/P50 of admitted latency is above 2. Paced, every
step that runs requests lasts at least as long as the same step would with `chunk_tokens` more prompt tokens:
the time is held for an arriving prompt, and a prompt of up to that many tokens joins without lengthening
anyone's step. The cost is median latency at low load (decode-only steps idle out the rest of their floor);
near capacity the steps are about that long anyway. The floor comes from the calibrated cost model, scaled by
how long steps that carried prompt tokens really took here: after an idle spell a step runs slower than the
back-to-back steps of the calibration (measured with the bundled model on a 2-core VM: a decode step 0.43 ->
0.8-1.0 ms, sleeping or spinning alike), and the floor is meant to fit a step with a chunk as it runs paced.
The idle part of a step is not billed (the meter counts it idle).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..cost.model import CostModel


@dataclass
class Pacer:
    cost: CostModel  # calibrated; read here, never corrected (the server's copy is)
    chunk_tokens: int
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    alpha: float = 0.05  # weight of the newest step with prompt tokens in `ratio`
    ratio: float = 1.0  # measured / calibrated time of steps that carried prompt tokens

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive")

    def floor_ns(self, num_seqs: int, context_tokens: int) -> int:
        """The expected time of a step of `num_seqs` running sequences plus one prompt chunk."""
        return int(self.cost.raw_step_us(num_seqs + self.chunk_tokens, context_tokens) * self.ratio * 1000)

    def observe(self, num_tokens: int, num_prompt_tokens: int, context_tokens: int, interval_ns: int) -> None:
        if num_prompt_tokens == 0:
            return
        raw_us = self.cost.raw_step_us(num_tokens, context_tokens)
        if raw_us > 0:
            self.ratio += self.alpha * (interval_ns / 1000 / raw_us - self.ratio)

    def idle_out(self, began_ns: int, floor_ns: int, clock: Callable[[], int]) -> int:
        """Sleeps until `floor_ns` after `began_ns`; returns the ns slept (0 when the step ran past it)."""
        start_ns = clock()
        left_ns = began_ns + floor_ns - start_ns
        if left_ns <= 0:
            return 0
        self.sleep(left_ns / 1e9)
        return clock() - start_ns
