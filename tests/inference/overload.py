"""A virtual-time overload for admission controllers: no engine, no clock, the same calls every run. Used by
the admission tests (decisions must not depend on the quick answers) and bench/admission_cpu.py (what a
decision costs when most calls are refused)."""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator, Sequence

from services.inference.admission import AdmissionController, Admit, Commitment, Decision, Reject

MS = 1_000_000


def overload(
    controllers: Sequence[AdmissionController], load: float, seconds: float, seed: int = 0
) -> Iterator[list[Decision]]:
    """Drives `controllers` in step through the same overload in virtual time: Poisson arrivals at `load` ×
    ~85 calls/s of 64+32 tokens with 2-s deadlines, a step every 6 ms, refused calls retrying at their hint.
    Yields each arrival's decisions (one per controller) as the engine and the calls would make them."""
    rng = random.Random(seed)
    arrivals, t_s = [], 0.0
    while t_s < seconds:
        t_s += rng.expovariate(85 * load)
        arrivals.append((int(t_s * 1e9), len(arrivals), f"r{len(arrivals)}", int(t_s * 1e9) + 2000 * MS))
    heapq.heapify(arrivals)
    running: dict[str, int] = {}
    next_step_ns, seq = 0, len(arrivals)
    while arrivals:
        at_ns, _, rid, deadline_ns = heapq.heappop(arrivals)
        while next_step_ns <= at_ns:
            for done in [r for r in running if running[r] + 1 >= 32]:
                running.pop(done)
                for c in controllers:
                    c.release(done)
            for r in running:
                running[r] += 1
                for c in controllers:
                    c.on_progress(r, running[r])
            next_step_ns += 6 * MS
            for c in controllers:  # that step ended and the next began (a tree before step_ended has none to tell)
                if hasattr(c, "step_ended"):
                    c.step_ended(next_step_ns - 6 * MS)
        decisions = [c.decide(Commitment(rid, 64, 32, deadline_ns), at_ns) for c in controllers]
        yield decisions
        if isinstance(decisions[0], Admit):
            running[rid] = 0
        elif isinstance(decisions[0], Reject) and decisions[0].within_budget:
            heapq.heappush(arrivals, (at_ns + decisions[0].retry_after_ms * MS, seq, rid, deadline_ns))
            seq += 1
