"""When and where to retry a Generate call. Pure: clocks and randomness are injected, nothing here does I/O,
so the sync and asyncio clients share it and tests drive it without a network.

The rules, in order:
  - Never retry a call the server had admitted (its stream began: tokens may have been delivered, and its
    usage may already be recorded), nor any code but RESOURCE_EXHAUSTED / UNAVAILABLE, nor a
    RESOURCE_EXHAUSTED that is not the server's OVERLOADED (gRPC's own size limits say it).
  - A quota refusal (QUOTA_EXCEEDED, or a google.rpc.QuotaFailure) is the tenant's cap, not a replica's load: never
    retried on another replica, and on the same one only after its hint, when that fits the deadline (calls per
    second); a monthly cap resets long after any deadline, so the call gives up at once.
  - RESOURCE_EXHAUSTED: the replica is busy until its hint (RetryInfo) plus a little jitter. If its
    x-server-time is more than `skew_threshold_s` off our clock, the hint is not trusted and exponential
    backoff with full jitter replaces it.
  - UNAVAILABLE: the replica is down for an exponential backoff (equal jitter, growing while it stays down).
    With a fallback model, a call that finds no replica up switches to it.
  - Go to another endpoint that is neither busy nor down, at once; otherwise wait for the endpoint that
    frees first. Never wait past the call's deadline: give up instead, at once.
  - Whether there is another replica is the client's own endpoint list, not the refusal's `elsewhere` (what the
    replica knows of its peers): with one endpoint, a refusal is retried at its hint only where the replica invites
    it (`retry_within_budget`, as a replica alone does when it reserved the retry a slot), else given up at once.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from .failure import Failure

RETRYABLE = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class RetryConfig:
    max_attempts: int = 8
    jitter_fraction: float = 0.1  # jitter added to a hint: up to this share of it ...
    max_jitter_ms: float = 20.0  # ... and at most this: the replica holds a retry's slot ~50 ms past the hint
    skew_threshold_s: float = 2.0
    backoff_base_ms: float = 25.0
    backoff_max_ms: float = 2_000.0
    # an attempt with less budget left is not sent: the replica's own safety margin is 20 ms + 5 % by default,
    # so it could never admit it
    min_attempt_budget_ms: float = 25.0
    fallback_model: str | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not 0 <= self.jitter_fraction <= 1 or self.max_jitter_ms < 0:
            raise ValueError("jitter_fraction must be in [0, 1] and max_jitter_ms >= 0")
        if self.backoff_base_ms <= 0 or self.backoff_max_ms < self.backoff_base_ms:
            raise ValueError("need 0 < backoff_base_ms <= backoff_max_ms")


@dataclass(frozen=True)
class Retry:
    endpoint: int
    delay_s: float
    reason: str  # failover, hint, clock_skew, no_hint, unavailable, fallback_model, quota


@dataclass(frozen=True)
class GiveUp:
    why: str  # not_retryable, after_admission, deadline, max_attempts, no_room_within_deadline, quota


Decision = Retry | GiveUp


@dataclass
class CallState:
    started_s: float
    deadline_s: float
    model: str
    num_attempts: int = 0
    on_fallback: bool = False


class EndpointBoard:
    """What the client knows of each endpoint, shared by all its calls (a busy replica is busy for everyone)."""

    def __init__(self, num_endpoints: int) -> None:
        self.free_at_s = [0.0] * num_endpoints  # monotonic time from which the endpoint may be tried
        self.why = [""] * num_endpoints  # what set free_at_s: hint, clock_skew, no_hint, unavailable
        self.num_down = [0] * num_endpoints  # consecutive UNAVAILABLE answers
        self.next_rr = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.free_at_s)

    def order_after(self, endpoint: int) -> list[int]:
        n = len(self)
        return [(endpoint + 1 + i) % n for i in range(n)]


class Retrier:
    """Decides, after each failed attempt, whether the call tries again, where and after how long (the rules
    above); one per client, shared by its calls, since what it learns of each endpoint (busy, down) is shared."""

    def __init__(
        self,
        config: RetryConfig,
        num_endpoints: int,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if num_endpoints < 1:
            raise ValueError("at least one endpoint")
        self.config = config
        self.board = EndpointBoard(num_endpoints)
        self.clock, self.wall_clock, self.rand = clock, wall_clock, rand

    def start(self, deadline_ms: float, model: str) -> CallState:
        if not deadline_ms > 0:
            raise ValueError(f"deadline_ms must be > 0, got {deadline_ms}")
        now = self.clock()
        return CallState(now, now + deadline_ms / 1000, model)

    def remaining_s(self, state: CallState) -> float:
        return state.deadline_s - self.clock()

    def first_endpoint(self) -> int:
        """Round robin over endpoints that are free now; if none is, the one that frees first (the server,
        not the client, decides whether a new call fits: a busy hint is no reason to hold a first try back)."""
        now = self.clock()
        with self.board.lock:
            order = self.board.order_after(self.board.next_rr - 1)
            busy = {e: self.board.free_at_s[e] for e in order if self.board.free_at_s[e] > now}
            pick = min(order, key=lambda e: (e in busy, busy.get(e, 0.0)))  # stable: rr order among free
            self.board.next_rr = (pick + 1) % len(self.board)
            return pick

    def on_admitted(self, endpoint: int) -> None:
        with self.board.lock:
            self.board.num_down[endpoint] = 0

    def after_failure(self, state: CallState, endpoint: int, failure: Failure) -> Decision:
        if failure.after_admission:
            return GiveUp("after_admission")
        if failure.code not in RETRYABLE:
            return GiveUp("not_retryable")
        if failure.is_quota:
            return self._after_quota(state, endpoint, failure)
        # RESOURCE_EXHAUSTED from gRPC itself (a message or headers past its limits) names no overload: the
        # same call would be refused again, on every replica
        if failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED and failure.reason != "OVERLOADED":
            return GiveUp("not_retryable")
        now = self.clock()
        with self.board.lock:
            wait_s = self._mark(endpoint, failure, state.num_attempts, now)
            if state.num_attempts >= self.config.max_attempts:
                return GiveUp("max_attempts")
            decision = self._choose(state, endpoint, failure, now, wait_s)
        # the replica found no room inside this call's budget: waiting for it is pointless, another may have room
        if failure.error_metadata.get("retry_within_budget") == "false" and decision.endpoint == endpoint:
            return GiveUp("no_room_within_deadline")
        if isinstance(decision, Retry) and not self._fits(state, now + decision.delay_s):
            return GiveUp("deadline")
        return decision

    def _after_quota(self, state: CallState, endpoint: int, failure: Failure) -> Decision:
        """The same endpoint once its hint has passed, if that leaves the call room; never another (the cap is the
        tenant's) and the endpoint board is left alone (the replica is not busy for anyone else)."""
        hint_ms = failure.retry_after_ms
        if hint_ms is None or hint_ms < 0 or state.num_attempts >= self.config.max_attempts:
            return GiveUp("quota")
        jitter_ms = self.rand() * min(self.config.max_jitter_ms, self.config.jitter_fraction * hint_ms)
        delay_s = (hint_ms + jitter_ms) / 1000
        if not self._fits(state, self.clock() + delay_s):
            return GiveUp("quota")
        return Retry(endpoint, delay_s, "quota")

    def _fits(self, state: CallState, at_s: float) -> bool:
        return state.deadline_s - at_s >= self.config.min_attempt_budget_ms / 1000

    def _mark(self, endpoint: int, failure: Failure, num_attempts: int, now: float) -> float:
        """Marks the endpoint busy or down; returns for how long."""
        board = self.board
        if failure.code == grpc.StatusCode.UNAVAILABLE:
            board.num_down[endpoint] += 1
            span_s = self._backoff_cap_s(board.num_down[endpoint])
            wait_s, why = span_s / 2 + self.rand() * span_s / 2, "unavailable"
        else:
            wait_s, why = self._overload_wait_s(failure, num_attempts)
        board.free_at_s[endpoint] = now + wait_s
        board.why[endpoint] = why
        return wait_s

    def _overload_wait_s(self, failure: Failure, num_attempts: int) -> tuple[float, str]:
        hint_ms = failure.retry_after_ms
        if hint_ms is None or hint_ms < 0:
            return self.rand() * self._backoff_cap_s(num_attempts), "no_hint"
        if (
            failure.server_time_us is not None
            and abs(failure.server_time_us / 1e6 - self.wall_clock()) > self.config.skew_threshold_s
        ):
            return self.rand() * self._backoff_cap_s(num_attempts), "clock_skew"
        jitter_ms = self.rand() * min(self.config.max_jitter_ms, self.config.jitter_fraction * hint_ms)
        return (hint_ms + jitter_ms) / 1000, "hint"

    def _backoff_cap_s(self, n: int) -> float:
        cfg = self.config
        return min(cfg.backoff_max_ms, cfg.backoff_base_ms * 2 ** max(n - 1, 0)) / 1000

    def _choose(self, state: CallState, failed: int, failure: Failure, now: float, failed_wait_s: float) -> Retry:
        board = self.board
        order = board.order_after(failed)
        free = [e for e in order if board.free_at_s[e] <= now]
        if free:
            return Retry(free[0], 0.0, "failover" if free[0] != failed else board.why[failed] or "failover")
        fallback = self.config.fallback_model
        if failure.code == grpc.StatusCode.UNAVAILABLE and fallback and not state.on_fallback:
            state.model, state.on_fallback = fallback, True
            return Retry(order[0], 0.0, "fallback_model")
        soonest = min(order, key=lambda e: board.free_at_s[e])
        # the wait itself, not (now + wait) - now: a rounding error must not cut a hint short
        delay_s = failed_wait_s if soonest == failed else board.free_at_s[soonest] - now
        return Retry(soonest, delay_s, board.why[soonest])
