"""What the server needs of an engine, wherever it runs: `EngineHandle`. Two implement it: `EngineClient`
(client.py, the engine in a child process: `zeroqueue serve`) and `EngineThread` (thread.py, the engine on a thread
of the server's process: `--engine-thread`). The server holds one and never asks which. No torch here.

A handle is made on the event loop with its two callbacks, both of which it calls on that loop: `on_lost(why)` when
the engine stopped for good while serving (a device fault, a dead process), and `on_verdict(state, ratio, why)`
with each of the device watchdog's verdicts (health/watchdog.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..health.state import DeviceState
from ..sched.request import Request
from .digest import StepObserver
from .engine import OutputSink
from .messages import Ready

OnLost = Callable[[str], None]
OnVerdict = Callable[[DeviceState, float, str], None]


class EngineHandle(Protocol):
    @property
    def observers(self) -> list[StepObserver]:
        """Who sees every step's digest, on the event loop or the engine's thread, before its outputs go out."""
        ...

    def launch(self) -> Ready:
        """Builds the engine, warms it up and calibrates it (blocking: call it off the event loop)."""
        ...

    def start(self) -> None:
        """On the event loop: the engine takes calls from now on, and the callbacks are called on this loop."""
        ...

    def stop(self, timeout_s: float = 10.0) -> None:
        """Lets the engine finish what it holds, then stops it (blocking: call it off the event loop)."""
        ...

    def add_request(self, request: Request, sink: OutputSink) -> None:
        """The call joins the very next step; its outputs go to `sink`. Raises errors.NotServing when the engine
        is gone."""
        ...

    def cancel(self, call_id: str) -> None:
        """Ends the call at the next step (its last output says cancelled); harmless when it is gone."""
        ...

    def set_expiry_guard(self, guard_ns: int) -> None:
        """Calls whose deadline falls within this of a step's start end before it (about one step)."""
        ...
