"""What crosses the pipe between the server process (client.py) and the engine process (core.py).

Server -> engine: ("add", Request), ("cancel", request_id), ("guard", guard_ns), ("stop",). Engine -> server:
("ready", Ready) or ("failed", text) before ready, then ("step", step_wire | None, [RequestOutput tuple]),
("idle", now_ns), ("device", DeviceState value, ratio, why) from the watchdog, and ("stopped",). The child is
built from an `EngineSpec`. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..device.spec import Device, ExecutorConfig
from ..health.faults import Fault
from ..health.watchdog import WatchdogConfig

if TYPE_CHECKING:
    from ..device.executor import Executor


@dataclass(frozen=True)
class EngineSpec:
    """Everything the child needs to build the engine; picklable."""

    model_dir: str
    dtype: str
    executor: ExecutorConfig
    max_num_batched_tokens: int
    calibrate: bool = True
    # a module-level callable: it crosses by reference (None: the Executor, imported in the child)
    make_executor: Callable[..., Executor] | None = None
    json_logs: bool | None = None  # configure structlog like the server (None: leave it)
    # a CPU engine process takes cores of its own and leaves the rest to the server (device/cpus.py); the
    # child decides, since only it knows (with torch) whether it runs on the CPU
    pin_cpus: bool = False
    pace_tokens: int = 0  # paced steps (pacing.py) with this chunk; 0: unpaced
    watchdog: WatchdogConfig | None = None  # watch the device once calibrated (health/watchdog.py); None: unwatched
    fault: Fault | None = None  # a fault injected on purpose (health/faults.py), armed once calibrated


@dataclass(frozen=True)
class Ready:
    device: Device
    num_slots: int
    max_seq_len: int
    max_num_batched_tokens: int
    cost_rows: tuple[int, ...] = ()  # the calibrated cost model, empty without calibration
    cost_row_us: tuple[float, ...] = ()
    cost_us_per_context_token: float = 0.0
    engine_cpus: tuple[int, ...] = ()  # with pin_cpus: the engine process's cores, and the server's
    server_cpus: tuple[int, ...] = ()


DEVICE_FAULT_EXIT = 3  # the child's exit status after a device fault


class EngineFailed(RuntimeError):
    """The engine process could not start (it names why) or died."""
