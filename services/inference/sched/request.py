"""A generation request as the engine sees it. No torch here: the scheduler imports this."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..grammar import Constraint


class RequestStatus(enum.IntEnum):
    """Ordered: everything from FINISHED_STOPPED on counts as finished."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_CANCELLED = 4
    FINISHED_EXPIRED = 5
    FINISHED_ERROR = 6
    FINISHED_GRAMMAR = 7  # its grammar's matcher failed mid-output (its per-token limits): the caller's grammar

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


class FinishReason(enum.StrEnum):
    """Why the engine ended a request, on its last output. Not the billed outcome (billing.records.Outcome, which
    services/inference/meter.py maps these to): "stop" and "length" are both an "ok" call."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    ERROR = "error"
    GRAMMAR = "grammar"  # the response_format's grammar went past its per-token limits: the call ends there


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_CANCELLED: FinishReason.CANCELLED,
    RequestStatus.FINISHED_EXPIRED: FinishReason.DEADLINE_EXCEEDED,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_GRAMMAR: FinishReason.GRAMMAR,
}


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 means no top-k filter
    seed: int = 0  # makes sampling reproducible whatever else shares the batch
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # keep going past end-of-sequence (benchmarks, calibration)
    constraint: Constraint | None = None  # structured output: every token is drawn under its grammar's mask
    logprobs: bool = False  # report each drawn token's log-probability
    top_logprobs: int = 0  # and of this many most likely tokens (needs logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def on_host(self) -> bool:
        """Its row's logits go to the host every step: it samples, or its grammar masks them, or it reports
        log-probabilities (a greedy row is drawn by the device's argmax alone)."""
        return not self.greedy or self.constraint is not None or self.logprobs


@dataclass(eq=False)
class Request:
    call_id: str  # the replica's id for the call (the caller's own request_id stays with the service)
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_ns: int  # engine clock (monotonic)
    deadline_ns: int | None = None  # engine clock; None means no deadline
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose k/v are in the cache
    slot: int | None = None  # its place among the calls that run at once
    block_ids: tuple[int, ...] = ()  # its KV block table, reserved whole when it starts (sched/blocks.py)
    num_cached_tokens: int = 0  # leading prompt tokens it found in the prefix cache, never computed for it
    cache_salt: bytes | None = None  # whose prefix cache it may read and add to; None: neither
    # its blocks came with it, reserved by deadline admission's pool in the server (which frees and caches them);
    # False: the scheduler's own pool reserves them when it starts (FIFO admission, tests, calibration)
    blocks_reserved: bool = False
    first_scheduled_ns: int | None = None  # start of the first step that ran it
    first_token_ns: int | None = None  # end of the step that produced its first token
    # its grammar's matcher (an llguidance.LLMatcher), the engine's own, set when the engine takes a constrained
    # request in; advanced by the sampler with every token drawn. Never crosses the pipe.
    matcher: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def num_remaining_prompt_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_computed_tokens

    @property
    def num_remaining_output_tokens(self) -> int:
        return self.sampling.max_tokens - self.num_output_tokens

    def token_at(self, position: int) -> int:
        if position < self.num_prompt_tokens:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - self.num_prompt_tokens]
