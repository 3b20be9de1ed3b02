"""The server's one reaction to the watchdog's verdict on the device (on the event loop): `DeviceReaction`.

Slow: admission predicts with the measured speed at once; healthy again: with the recovered speed at once. Failed:
the calls in flight end now (told UNAVAILABLE, DEVICE_FAILED, instead of waiting out their deadlines, and billed
for the steps that ran when their streams take the end), and readiness goes NOT_SERVING; liveness too if the
device has not recovered within `recovery_s`. Recovered: SERVING again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from ..card import WarmupState
from ..engine.engine import RequestOutput
from ..sched.request import FinishReason
from .state import DeviceState

if TYPE_CHECKING:
    from ..cost.model import CostModel
    from ..metrics import ServiceMetrics
    from ..service import InferenceService

log = structlog.get_logger(__name__)

SetHealth = Callable[[bool, tuple[str, ...]], None]  # (serving?, the health service names it applies to)


class DeviceReaction:
    def __init__(
        self,
        service: InferenceService,
        cost: CostModel | None,
        metrics: ServiceMetrics,
        set_health: SetHealth,
        readiness: tuple[str, ...],
        liveness: str,
        recovery_s: float,
    ) -> None:
        self.service, self.cost, self.metrics = service, cost, metrics
        self.set_health, self.readiness, self.liveness = set_health, readiness, liveness
        self.recovery_s = recovery_s
        self._not_recovered: asyncio.TimerHandle | None = None  # takes liveness down unless the device recovers

    def __call__(self, state: DeviceState, ratio: float, why: str) -> None:
        service = self.service
        if service.device_state is state:
            return
        previous, service.device_state = service.device_state, state
        self.metrics.set_device_state(state)
        if self.cost is not None and state is DeviceState.SLOW:
            self.cost.follow(ratio)
        elif self.cost is not None and state is DeviceState.HEALTHY:
            self.cost.settle(ratio)
        if state is DeviceState.FAILED:
            self._end_in_flight(why)
            self.set_health(False, self.readiness)
            self._not_recovered = asyncio.get_running_loop().call_later(self.recovery_s, self._gave_up)
        elif previous is DeviceState.FAILED and service.state is WarmupState.READY:
            if self._not_recovered is not None:
                self._not_recovered.cancel()
            self.set_health(True, (*self.readiness, self.liveness))

    def _end_in_flight(self, why: str) -> None:
        """Every call in flight ends now with "error", marked as ended by the device (the stream bills it for
        what it relayed); the engine drops them whenever it runs again."""
        service = self.service
        now_ns = service.clock.now_ns()
        for ticket in service.in_flight.values():
            if ticket.finish_reason is None and ticket.device_failure is None:
                ticket.device_failure = why
                service.engine.cancel(ticket.call_id)
                ticket.outputs.put_nowait(
                    RequestOutput(ticket.call_id, (), "", now_ns, ticket.num_output_tokens, FinishReason.ERROR)
                )

    def _gave_up(self) -> None:
        log.error("device_not_recovered", after_s=self.recovery_s)
        self.set_health(False, (self.liveness,))
