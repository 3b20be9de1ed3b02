"""`EngineThread`: the engine on a thread of the server's process (`zeroqueue serve --engine-thread`), behind the
same handle as the child process's client (handle.py). The observers run on the engine's thread; the callbacks
are handed to the event loop. No torch here: the engine is built (and torch imported) by `launch`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..health.state import DeviceState
from ..sched.request import Request
from .core import build_engine
from .digest import StepObserver
from .engine import Engine, OutputSink
from .handle import OnLost, OnVerdict
from .messages import EngineSpec, Ready


class EngineThread:
    def __init__(
        self,
        spec: EngineSpec,
        clock: Callable[[], int],
        on_lost: OnLost | None = None,
        on_verdict: OnVerdict | None = None,
    ) -> None:
        self.spec = spec
        self.clock = clock  # as the client's: the engine in this process reads the same monotonic clock itself
        self.on_lost = on_lost
        self.on_verdict = on_verdict
        self._engine: Engine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # where the callbacks run, from start() on

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("the engine is not launched yet")
        return self._engine

    @property
    def observers(self) -> list[StepObserver]:
        return self.engine.observers

    def launch(self) -> Ready:
        self._engine, ready = build_engine(self.spec, on_verdict=self._verdict, on_lost=self._lost)
        return ready

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._engine is not None:
            self._engine.stop(timeout_s)

    def add_request(self, request: Request, sink: OutputSink) -> None:
        self.engine.add_request(request, sink)

    def cancel(self, call_id: str) -> None:
        self.engine.cancel(call_id)

    def set_expiry_guard(self, guard_ns: int) -> None:
        self.engine.set_expiry_guard(guard_ns)

    # ---- the engine's thread, or the watchdog's: handed to the loop, as the client's pipe hands them ----
    def _lost(self, why: str) -> None:
        if self._loop is not None and self.on_lost is not None:
            self._loop.call_soon_threadsafe(self.on_lost, why)

    def _verdict(self, state: DeviceState, ratio: float, why: str) -> None:
        # verdicts before start(), while warming up, are heard by no one (the watchdog logs each one)
        if self._loop is not None and self.on_verdict is not None:
            self._loop.call_soon_threadsafe(self.on_verdict, state, ratio, why)
