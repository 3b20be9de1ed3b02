"""One call as the service holds it: its validated spec (servicer.py makes it from protobuf), and once admitted
its ticket and the sink its engine outputs land in (`LoopSink`). No protobuf, no torch."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from billing.records import Door, RequestKind, UsageRecord

from .meter import RecordContext
from .sched.request import FinishReason, Request, SamplingParams

if TYPE_CHECKING:
    from .engine.engine import RequestOutput


class BudgetSource(enum.Enum):
    """Where a call's budget came from: over gRPC its deadline; over HTTP (services/http/calls.py) the first of
    an explicit header, the official SDKs' own timeout, Envoy's expected timeout; else the server's default."""

    CLIENT_DEADLINE = "client_deadline"
    SERVER_DEFAULT = "server_default"
    BUDGET_HEADER = "x-budget-ms"
    SDK_TIMEOUT = "x-stainless-timeout"
    ENVOY_TIMEOUT = "x-envoy-expected-rq-timeout-ms"


@dataclass(frozen=True)
class GenerateSpec:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    labels: Mapping[str, str]
    retry_attempt: int = 0
    service_class: str = ""  # the class the request named (its size and characters checked); "": none
    kind: RequestKind = RequestKind.PLAIN  # plain, chat, constrained or both: what the usage record bills
    door: Door = Door.GRPC  # the door it came through: labels its usage record, nothing else


@dataclass
class Ticket:
    """One admitted call. The engine, the meter and the outbox know it by `call_id`, which this replica made;
    the caller's request_id is an idempotency key scoped to its tenant (`key`), never a handle."""

    spec: GenerateSpec
    context: RecordContext  # tenant, labels and times: what the meter bills the call with
    call_id: str
    request: Request
    outputs: asyncio.Queue
    budget_ms: int
    budget_source: BudgetSource
    predicted_finish_ns: int
    predicted_start_ns: int | None = None  # held inside its slack: the slot planned for it (None: the next step)
    first_scheduled_ns: int | None = None
    first_token_ns: int | None = None
    finished_ns: int | None = None
    finish_reason: FinishReason | None = None
    num_output_tokens: int = 0
    usage_on_disk: Future | None = None  # the outbox resolves it once the usage record is durable
    usage: UsageRecord | None = None
    device_failure: str | None = None  # why the call was ended when the device stopped answering
    compile_us: int = 0  # the server's compile of its response_format before admission (0: cached, or none)
    # the KV blocks admission's pool reserved for it (its cached prefix's first), until it ends; () once freed
    kv_blocks: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)  # streamed so far: they key its blocks at the end

    @property
    def tenant(self) -> str:
        return self.context.tenant

    @property
    def service_class(self) -> str:
        """The class the call runs and is billed in."""
        return self.context.service_class

    @property
    def received_ns(self) -> int:
        return self.context.received_ns

    @property
    def dispatched_ns(self) -> int:
        return self.context.dispatched_ns

    @property
    def deadline_ns(self) -> int:
        return self.context.deadline_ns

    @property
    def deadline_met(self) -> bool:
        return self.finished_ns is not None and self.finished_ns <= self.deadline_ns

    @property
    def key(self) -> tuple[str, str]:
        return self.tenant, self.spec.request_id

    @property
    def admission_key(self) -> str:
        return admission_key(self.tenant, self.spec.request_id)

    def summary(self, outcome: str, now_ns: int) -> dict[str, object]:
        """The fields of the call's `request_done` log line; times from its arrival, in ms."""

        def since_received_ms(at_ns: int | None) -> int | None:
            return None if at_ns is None else (at_ns - self.received_ns) // 1_000_000

        return {
            "request_id": self.spec.request_id,
            "call_id": self.call_id,
            "tenant": self.tenant,
            "service_class": self.service_class,
            "outcome": outcome,
            "prompt_tokens": len(self.spec.prompt_token_ids),
            # the usage record's count (FIFO: the engine's); else what deadline admission's pool found at admission
            "cached_prompt_tokens": self.usage.cached_prompt_tokens if self.usage else self.request.num_cached_tokens,
            "completion_tokens": self.num_output_tokens,
            "budget_ms": self.budget_ms,
            "predicted_finish_ms": since_received_ms(self.predicted_finish_ns),
            "actual_finish_ms": since_received_ms(self.finished_ns or now_ns),
            "ttft_ms": since_received_ms(self.first_token_ns),
            "deadline_met": self.deadline_met,
        }


def admission_key(tenant: str, request_id: str) -> str:
    """The tenant-scoped key admission holds a call's slot (and a refused call's reservation) under: a retry
    with the same request_id finds its reservation, another tenant's call with that id does not. Tenant
    names have no '/'."""
    return f"{tenant}/{request_id}"


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@dataclass
class LoopSink:
    """Hands engine outputs to the request's queue on the event loop (from the engine's thread, or from the
    loop itself when the engine runs in its own process)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, output: RequestOutput) -> None:
        if _running_loop() is self.loop:  # the engine process's relay: no wake-up through the self-pipe
            self.queue.put_nowait(output)
        else:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, output)
