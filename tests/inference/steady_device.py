"""A virtual-time replica whose device runs exactly as its calibration says: each step takes the calibrated time
of its rows, prompts join the next step in order within its token budget and the free slots, a call gets a token
per step, and a call admission held for a later start (`Admit.start_ns`) joins then, or when admission says a
slot freed early (`due`), as the service hands it to the engine. Open-
loop Poisson arrivals; a refused call retries at its hint while the hint fits its budget, up to `max_attempts`.
Calls whose start has come join in deadline order, as deadline admission's engine starts them; FIFO's in arrival
order.
What the admission tests use to judge promises on a device that keeps them: a reserved retry that comes on time
must be admitted, and an admitted call must finish in its deadline."""

from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import dataclass, field

from services.inference.admission import AdmissionController, Admit, Commitment, FifoAdmission, Reject
from services.inference.cost.model import CostModel

MS = 1_000_000


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    misses: list[str] = field(default_factory=list)  # admitted calls that finished past their deadline
    by_tenant: dict[str, Counter[str]] = field(default_factory=dict)  # by stream: calls, admitted, in_deadline

    @property
    def num_admitted(self) -> int:
        return sum(n for outcome, n in self.outcomes.items() if outcome.endswith("_admit"))

    def goodput(self, seconds: float) -> float:
        """Calls finished inside their deadline per second."""
        return (self.num_admitted - len(self.misses)) / seconds


def run(
    controller: AdmissionController | FifoAdmission,
    rate_per_s: float | dict[str, float],
    seconds: float,
    seed: int = 0,
    prompt_tokens: int = 64,
    max_tokens: int = 32,
    budget_ms: int = 2000,
    max_attempts: int = 8,
    streams: dict[str, tuple[str, int, int]] | None = None,
    device: tuple[CostModel, int, int] | None = None,
    cached_tokens: int = 0,
    burst_every_s: float | None = None,
) -> Tally:
    """`rate_per_s`: one tenant's ("t") rate, or each stream's. A stream is a tenant's calls of one class: by
    default its name is its tenant's, of priority 0 and `budget_ms`; `streams` names (tenant, priority, budget_ms)
    for others. The Tally's by_tenant is by stream. `device`: (cost model, slots, step token budget), for a FIFO
    controller, which knows none of them; its calls' clients give up at their deadline (a call waiting or running
    then leaves the engine, as a cancelled gRPC call does), and each is counted a miss. `cached_tokens`: each call's
    leading prompt tokens the prefix cache holds: admission is told, and the device never runs them.
    `burst_every_s`: instead of Poisson, a period's worth of each stream's calls arrives at once, every period (the
    board's bursts, `bench/board.py --arrivals burst`)."""
    streams = streams or {}
    if device is None:
        cost, num_slots, budget = (
            controller.predictor.cost,
            controller.config.num_slots,
            controller.config.max_num_batched_tokens,
        )
    else:
        cost, num_slots, budget = device
    give_up = not controller.predicts
    rng, tally = random.Random(seed), Tally()
    rates = rate_per_s if isinstance(rate_per_s, dict) else {"t": rate_per_s}
    arrivals = []  # (at_ns, seq, request id, deadline_ns, attempt, held a reservation)
    for stream, rate in rates.items():
        tally.by_tenant[stream] = Counter()
        stream_budget_ms = streams.get(stream, (stream, 0, budget_ms))[2]
        t_s, num_calls, per_burst = 0.0, 0, max(round(rate * (burst_every_s or 0)), 1)
        while t_s < seconds:
            if burst_every_s:
                t_s = num_calls // per_burst * burst_every_s
                if t_s >= seconds:
                    break
            else:
                t_s += rng.expovariate(rate)
            num_calls += 1
            rid = f"{stream}/r{len(arrivals)}"
            arrivals.append((int(t_s * 1e9), len(arrivals), rid, int(t_s * 1e9) + stream_budget_ms * MS, 0, False))
            tally.by_tenant[stream]["calls"] += 1
    heapq.heapify(arrivals)
    seq, now_ns = len(arrivals), 0
    pending: list[str] = []  # admitted, prompt not yet run, in the engine's order (by start, then admission)
    starts: dict[str, int] = {}  # pending: the earliest start (0: now)
    generated: dict[str, int] = {}  # running: tokens so far
    deadlines: dict[str, int] = {}
    prompt_left: dict[str, int] = {}  # pending calls whose prompt began: tokens still to run
    admitted_at: dict[str, tuple[int, int]] = {}  # when admitted, predicted finish

    def arrive() -> None:
        nonlocal seq
        at_ns, _, rid, deadline_ns, attempt, held = heapq.heappop(arrivals)
        stream = rid.split("/")[0]
        tenant, priority, _ = streams.get(stream, (stream, 0, budget_ms))
        commitment = Commitment(
            rid,
            prompt_tokens,
            max_tokens,
            deadline_ns,
            tenant=tenant,
            attempt=attempt,
            priority=priority,
            num_cached_tokens=cached_tokens,
        )
        decision = controller.decide(commitment, at_ns)
        kind = "retry_on_time" if held else ("retry" if attempt else "first")
        tally.outcomes[f"{kind}_{type(decision).__name__.lower()}"] += 1
        if held and isinstance(decision, Reject):  # a promise not kept: why
            tally.outcomes[f"retry_on_time_refused_{decision.reason}"] += 1
        if isinstance(decision, Reject):
            tally.by_tenant[stream][f"refused_{decision.reason}"] += 1
        if isinstance(decision, Admit):
            tally.by_tenant[stream]["admitted"] += 1
            starts[rid] = decision.start_ns or 0
            i = len(pending)
            while i and starts[pending[i - 1]] > starts[rid]:
                i -= 1
            pending.insert(i, rid)
            deadlines[rid] = deadline_ns
            admitted_at[rid] = (at_ns, decision.predicted_finish_ns)
        elif isinstance(decision, Reject) and decision.within_budget and attempt + 1 < max_attempts:
            retry_ns = at_ns + decision.retry_after_ms * MS
            if deadline_ns - retry_ns >= 25 * MS:
                heapq.heappush(arrivals, (retry_ns, seq, rid, deadline_ns, attempt + 1, decision.reserved))
                seq += 1

    while arrivals or generated or pending:
        for rid in [r for r in (*pending, *generated) if give_up and deadlines[r] <= now_ns]:
            pending.remove(rid) if rid in pending else generated.pop(rid)
            prompt_left.pop(rid, None)
            controller.release(rid)
            admitted_at.pop(rid)
            tally.misses.append(deadlines.pop(rid) and rid)
        if not (arrivals or generated or pending):
            break
        runnable = generated or (pending and starts[pending[0]] <= now_ns)
        if not runnable:  # idle until the next arrival, or the first held call's start
            held_ns = starts[pending[0]] if pending else None
            if arrivals and (held_ns is None or arrivals[0][0] <= held_ns):
                now_ns = max(now_ns, arrivals[0][0])
                arrive()
            else:
                now_ns = max(now_ns, held_ns)
            continue
        # one step from now_ns: every running call decodes a token, then prompts in order, in chunks, within
        # the step's token budget and the free slots; a call's first token comes with its prompt's last chunk
        rows, joining = len(generated), []
        if not give_up:  # deadline admission's engine starts waiting calls by deadline (sched/scheduler.py)
            ready = sorted(
                (r for r in pending if starts[r] <= now_ns), key=lambda r: (r not in prompt_left, deadlines[r])
            )
            pending[:] = ready + [r for r in pending if starts[r] > now_ns]

        while pending and rows < budget and starts[pending[0]] <= now_ns:
            # a prompt begun holds its slot; another needs a free one
            if pending[0] not in prompt_left and len(generated) + len(joining) + len(prompt_left) >= num_slots:
                break
            left = prompt_left.get(pending[0], prompt_tokens - cached_tokens)  # the cached prefix never runs
            chunk = min(left, budget - rows)
            rows += chunk
            prompt_left[pending[0]] = left - chunk
            if prompt_left[pending[0]] == 0:
                del prompt_left[pending[0]]
                joining.append(pending.pop(0))
            else:
                break  # its prompt goes on next step, in its slot
        end_ns = now_ns + int(cost.raw_step_us(rows) * 1000)
        while arrivals and arrivals[0][0] < end_ns:  # decided during the step: they join a later one
            arrive()
        now_ns = end_ns
        controller.step_ended(end_ns)  # as the service's step observer tells it, before the step's tokens
        for rid in list(generated):
            generated[rid] += 1
        for rid in joining:
            generated[rid] = 1
        for rid, count in list(generated.items()):
            controller.on_progress(rid, count)
            if count >= max_tokens:
                del generated[rid]
                controller.release(rid)
                for early in controller.due(now_ns):  # a slot freed early: a held call starts now, as the service's
                    assert early in pending and starts[early] > now_ns, "only a call still held may start early"
                    starts[early] = now_ns
                    pending.remove(early)
                    pending.insert(sum(1 for r in pending if starts[r] <= now_ns), early)
                at_ns, predicted_ns = admitted_at.pop(rid)
                controller.observe_finish(predicted_ns - at_ns, now_ns - at_ns)  # as the service does
                if now_ns > deadlines.pop(rid):
                    tally.misses.append(rid)
                else:
                    tally.by_tenant[rid.split("/")[0]]["in_deadline"] += 1
    return tally
