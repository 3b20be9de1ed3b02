"""Faults made on purpose, for tests and drills; off unless `zeroqueue serve --inject-fault` asks. No torch here.

The executor is slowed by a factor, hung, or made to fail with a device fault, from a chosen moment (seconds after
the replica starts serving) and for a chosen time (for good when not given):

    slow:4,after=10,for=20    steps and probes take 4x as long, from 10 s after SERVING, for 20 s
    hang,after=5,for=3        the device stops answering for 3 s (every operation waits out the fault)
    fail,after=5              the first operation after 5 s raises a device fault (the engine process exits)
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..device.spec import InjectedDeviceFault


class FaultKind(enum.StrEnum):
    SLOW = "slow"
    HANG = "hang"
    FAIL = "fail"


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    factor: float = 1.0  # slow: how many times as long each operation takes
    after_s: float = 0.0  # from the moment the engine is armed (the replica serves)
    for_s: float | None = None  # None: for good

    @classmethod
    def parse(cls, text: str) -> Fault:
        """`KIND[:FACTOR][,after=S][,for=S]`; ValueError naming what is wrong."""
        head, *options = text.split(",")
        kind_text, _, factor_text = head.partition(":")
        try:
            kind = FaultKind(kind_text.strip())
        except ValueError:
            raise ValueError(f"fault kind {kind_text!r}: use slow:FACTOR, hang or fail") from None
        if (kind is FaultKind.SLOW) != bool(factor_text):
            raise ValueError("a factor goes with slow, and only with slow (slow:4)")
        values = {"after": 0.0, "for": None}
        for option in options:
            name, _, value = option.partition("=")
            if name.strip() not in values:
                raise ValueError(f"fault option {name!r}: use after=SECONDS or for=SECONDS")
            values[name.strip()] = _seconds(value)
        factor = _number(factor_text, "factor") if factor_text else 1.0
        if kind is FaultKind.SLOW and factor < 1:
            raise ValueError("a slowdown factor is at least 1")
        return cls(kind, factor, values["after"], values["for"])


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):  # NaN fails the first test
        raise ValueError(f"{what} {text!r} must be a finite number, at least 0")
    return value


def _seconds(text: str) -> float:
    return _number(text.strip().removesuffix("s"), "seconds")


class ExecutorLayer:
    """An executor wrapped by another (a fault beneath, the watchdog's timing above): the engine sizes its
    scheduler by the executor it runs, so a layer says the slots, the context and the KV blocks of the one beneath."""

    executor: Any

    @property
    def num_slots(self) -> int:
        return self.executor.num_slots

    @property
    def max_seq_len(self) -> int:
        return self.executor.max_seq_len

    @property
    def block_size(self) -> int:
        return self.executor.block_size

    @property
    def num_blocks(self) -> int:
        return self.executor.num_blocks


class FaultyExecutor(ExecutorLayer):
    """The executor, with the fault applied to each operation while the fault is active."""

    def __init__(
        self,
        executor: Any,
        fault: Fault,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.executor, self.fault, self.clock, self.sleep = executor, fault, clock, sleep
        self._armed_at: float | None = None

    def arm(self) -> None:
        """Starts the fault's clock: the replica serves from now on (calibration ran without the fault)."""
        self._armed_at = self.clock()

    def run(self, step):
        return self._apply(lambda: self.executor.run(step))

    def probe(self) -> None:
        self._apply(self.executor.probe)

    def _remaining_s(self) -> float | None:
        """Seconds left of an active fault (inf: for good), or None when it is not active."""
        if self._armed_at is None:
            return None
        elapsed = self.clock() - self._armed_at - self.fault.after_s
        if elapsed < 0:
            return None
        if self.fault.for_s is None:
            return float("inf")
        return self.fault.for_s - elapsed if elapsed < self.fault.for_s else None

    def _apply(self, operation: Callable[[], Any]) -> Any:
        remaining = self._remaining_s()
        if remaining is None:
            return operation()
        if self.fault.kind is FaultKind.FAIL:
            raise InjectedDeviceFault("injected device fault (--inject-fault fail)")
        if self.fault.kind is FaultKind.HANG:
            while (remaining := self._remaining_s()) is not None:  # a hang for good never returns
                self.sleep(min(remaining, 0.05))
            return operation()
        started = self.clock()
        result = operation()
        self.sleep((self.fault.factor - 1) * (self.clock() - started))
        return result
