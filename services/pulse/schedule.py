"""The pulse test's plan, fixed before anything is sent: when each request arrives and what it asks for.

Arrivals follow a piecewise-constant rate (a base QPS with bursts of `pulse_factor`× lasting `pulse_s`,
one per `pulse_every_s`). Poisson arrivals are unit-rate exponential gaps mapped through the integrated
rate; constant arrivals are evenly spaced in it. The articles' two other shapes: `burst`, every
`pulse_every_s` a burst of qps × pulse_every_s calls sent at once (as `hey -c` does), and `stages`, a ramp up to
qps over the first quarter of the run, a plateau, and a ramp down over the last quarter (as k6's stages do),
Poisson inside each step of the ramp. Everything comes from one seed, so the same schedule can be replayed
against a deadline-mode and a fifo-mode replica. With request templates (templates.py), each call also draws
what kind of call it is.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from .templates import RequestTemplate, TemplateDraw, kind_of

ARRIVALS = ("poisson", "constant", "burst", "stages")
RAMP_STEPS = 8  # steps of a stages ramp


@dataclass(frozen=True)
class LoadSpec:
    qps: float
    duration_s: float
    arrival: str = "poisson"  # poisson | constant | burst | stages
    pulse_factor: float = 1.0  # rate multiplier inside a burst
    pulse_s: float = 0.0  # burst length
    pulse_every_s: float = 10.0  # one burst per this period, centred in it
    seed: int = 0

    def __post_init__(self) -> None:
        if self.qps <= 0 or self.duration_s <= 0:
            raise ValueError("qps and duration must be > 0")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if self.pulse_factor <= 0 or self.pulse_s < 0 or (self.pulse_s > 0 and self.pulse_s > self.pulse_every_s):
            raise ValueError("need pulse_factor > 0 and 0 <= pulse_s <= pulse_every_s")

    def segments(self) -> list[tuple[float, float, float]]:
        """(start_s, end_s, rate_qps) covering [0, duration_s)."""
        if self.arrival == "stages":
            return self._stages()
        if self.pulse_s == 0 or self.pulse_factor == 1:
            return [(0.0, self.duration_s, self.qps)]
        cuts, out, period = [], [], self.pulse_every_s
        k = 0
        while k * period < self.duration_s:
            start = k * period + (period - self.pulse_s) / 2
            cuts.append((start, start + self.pulse_s))
            k += 1
        t = 0.0
        for start, end in cuts:
            for a, b, rate in ((t, start, self.qps), (start, end, self.qps * self.pulse_factor)):
                a, b = max(a, 0.0), min(b, self.duration_s)
                if b > a:
                    out.append((a, b, rate))
            t = end
        if t < self.duration_s:
            out.append((t, self.duration_s, self.qps))
        return out

    def _stages(self) -> list[tuple[float, float, float]]:
        """A ramp up to qps in RAMP_STEPS steps over the first quarter, the plateau, and the ramp down."""
        ramp_s, step_s = self.duration_s / 4, self.duration_s / 4 / RAMP_STEPS
        up = [(i * step_s, (i + 1) * step_s, self.qps * (i + 1) / RAMP_STEPS) for i in range(RAMP_STEPS)]
        down = [(self.duration_s - b, self.duration_s - a, rate) for a, b, rate in reversed(up)]
        return [*up, (ramp_s, self.duration_s - ramp_s, self.qps), *down]

    @property
    def burst_size(self) -> int:
        """Calls in each burst of `burst` arrivals: the base rate's worth of one period."""
        return max(round(self.qps * self.pulse_every_s), 1)

    def rate_at(self, t_s: float) -> float:
        return next((rate for a, b, rate in self.segments() if a <= t_s < b), 0.0)


@dataclass(frozen=True)
class ShapeSpec:
    kind: str = "fixed"  # fixed | mix
    prompt_tokens: int = 64  # fixed: exact; mix: median of a log-normal
    max_tokens: int = 32
    sigma: float = 0.6  # mix: log-normal spread
    context_length: int = 1024  # prompt + max_tokens stay inside it

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "mix"):
            raise ValueError(f"shape must be fixed or mix, got {self.kind!r}")
        if self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        if self.prompt_tokens + self.max_tokens > self.context_length:
            raise ValueError(
                f"prompt ({self.prompt_tokens}) + max_tokens ({self.max_tokens}) exceed the context "
                f"({self.context_length})"
            )


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    at_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    deadline_ms: float
    service_class: str = ""  # GenerateRequest.service_class ("": the replica picks by the budget)
    template: RequestTemplate | None = None  # what else it sends (None: a plain call on prompt_token_ids)

    @property
    def kind(self) -> str:
        """plain, chat, constrained or chat_constrained."""
        return kind_of(self.template)


def arrival_times(load: LoadSpec, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration): the k-th arrival is where the integrated rate reaches the k-th mark; for
    bursts, `burst_size` calls at the start of every period."""
    if load.arrival == "burst":
        starts = [k * load.pulse_every_s for k in range(int(-(-load.duration_s // load.pulse_every_s)))]
        return [at_s for at_s in starts for _ in range(load.burst_size)]
    marks, total = [], 0.0
    capacity = sum((b - a) * rate for a, b, rate in load.segments())
    while True:
        total += 1.0 if load.arrival == "constant" else rng.expovariate(1.0)
        if total > capacity:
            break
        marks.append(total - 0.5 if load.arrival == "constant" else total)
    times, segments, i, before = [], load.segments(), 0, 0.0
    for mark in marks:
        while before + (segments[i][1] - segments[i][0]) * segments[i][2] < mark:
            before += (segments[i][1] - segments[i][0]) * segments[i][2]
            i += 1
        a, _, rate = segments[i]
        times.append(a + (mark - before) / rate)
    return times


def _lengths(shape: ShapeSpec, rng: random.Random) -> tuple[int, int]:
    if shape.kind == "fixed":
        return shape.prompt_tokens, shape.max_tokens
    prompt = max(1, round(shape.prompt_tokens * rng.lognormvariate(0.0, shape.sigma)))
    output = max(1, round(shape.max_tokens * rng.lognormvariate(0.0, shape.sigma)))
    prompt = min(prompt, shape.context_length - 1)
    return prompt, min(output, shape.context_length - prompt)


def plan(
    load: LoadSpec,
    shape: ShapeSpec,
    vocab_size: int,
    deadline_ms: float,
    deadline_per_token_ms: float = 0.0,
    first_token_id: int = 16,
    service_class: str = "",
    templates: Sequence[RequestTemplate] = (),
) -> list[PlannedRequest]:
    """The whole schedule. Prompt tokens are drawn from [first_token_id, vocab_size) so low special ids stay out.
    With `templates`, each call draws one by weight: a template's max_tokens and deadline_ms replace the shape's
    and `deadline_ms`, and one with its own prompt or messages sends no token ids. Every call draws its lengths and
    token ids all the same, so the arrivals and the plain calls are those of a plan without templates."""
    if deadline_ms <= 0:
        raise ValueError("deadline_ms must be > 0")
    rng = random.Random(load.seed)
    draw = TemplateDraw(templates, load.seed) if templates else None
    requests = []
    for index, at_s in enumerate(arrival_times(load, rng)):
        prompt_len, max_tokens = _lengths(shape, rng)
        prompt = tuple(rng.randrange(first_token_id, vocab_size) for _ in range(prompt_len))
        template = draw.next() if draw is not None else None
        base_ms = deadline_ms
        if template is not None:
            if template.max_tokens is not None:
                limit = shape.context_length - len(prompt) if template.uses_token_ids else shape.context_length
                max_tokens = min(template.max_tokens, limit)
            if not template.uses_token_ids:
                prompt = ()
            base_ms = template.deadline_ms or deadline_ms
        deadline = base_ms + deadline_per_token_ms * max_tokens
        requests.append(PlannedRequest(index, at_s, prompt, max_tokens, deadline, service_class, template))
    return requests
