"""What crosses the pipe between the server process (client.py) and the engine process (core.py): every message
is one of the small typed values below, its kind one of `Kind`, and it travels as a plain tuple (its kind's string
first) that `encode` builds and `decode` reads; nothing else builds or reads those tuples.

Server -> engine: `Add` (a call's Request), `Cancel`, `Guard` (the expiry guard), `Stop`. Engine -> server:
`Ready` or `Failed` before ready, then `Step` (the step's digest as `step_wire` builds it, and its outputs as plain
tuples: both pickle several times faster than dataclasses, and a step sends one every step), `Idle`, `Verdict`
(the watchdog's, on the device), and `Stopped`. The child is built from an `EngineSpec`. No torch here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cost.model import CostModel
from ..device.spec import Device, ExecutorConfig
from ..health.faults import Fault
from ..health.state import DeviceState
from ..health.watchdog import WatchdogConfig
from ..sched.request import Request

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
    json_logs: bool | None = None  # log JSON lines like the server (None or False: console lines), on stderr
    # a CPU engine process takes cores of its own and leaves the rest to the server (device/cpus.py); the
    # child decides, since only it knows (with torch) whether it runs on the CPU
    pin_cpus: bool = False
    pace_tokens: int = 0  # paced steps (pacing.py) with this chunk; 0: unpaced
    watchdog: WatchdogConfig | None = None  # watch the device once calibrated (health/watchdog.py); None: unwatched
    fault: Fault | None = None  # a fault injected on purpose (health/faults.py), armed once calibrated
    # deadline admission's engine starts waiting calls by deadline (sched/scheduler.py); FIFO's in arrival order
    earliest_deadline_first: bool = False


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine is built, warm and calibrated: what the server needs to know of it."""

    device: Device
    num_slots: int
    max_seq_len: int
    max_num_batched_tokens: int
    cost_rows: tuple[int, ...] = ()  # the calibrated cost model, empty without calibration
    cost_row_us: tuple[float, ...] = ()
    cost_us_per_context_token: float = 0.0
    cost_us_per_masked_row: float = 0.0
    cost_us_per_logprob_row: float = 0.0
    cost_us_per_prefill_context_token: float = 0.0
    engine_cpus: tuple[int, ...] = ()  # with pin_cpus: the engine process's cores, and the server's
    server_cpus: tuple[int, ...] = ()
    num_kv_blocks: int = 0  # the paged KV cache's pool (device/attention.py), blocks of kv_block_size tokens
    kv_block_size: int = 0
    weight_dtype: str = ""  # the linear weights: int8 / fp8 when the executor quantized them, else the dtype

    def cost_model(self) -> CostModel:
        """The calibrated cost model, rebuilt in the server from what crossed the pipe."""
        return CostModel(
            list(self.cost_rows),
            list(self.cost_row_us),
            self.cost_us_per_context_token,
            self.cost_us_per_masked_row,
            self.cost_us_per_logprob_row,
            self.cost_us_per_prefill_context_token,
        )


DEVICE_FAULT_EXIT = 3  # the child's exit status after a device fault


class EngineFailed(RuntimeError):
    """The engine process could not start (it names why) or died."""


class Kind(enum.StrEnum):
    """A message's kind: the first element of its tuple on the pipe."""

    ADD = "add"
    CANCEL = "cancel"
    GUARD = "guard"
    STOP = "stop"
    READY = "ready"
    FAILED = "failed"
    STEP = "step"
    IDLE = "idle"
    VERDICT = "device"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class Add:
    request: Request


@dataclass(frozen=True, slots=True)
class Cancel:
    call_id: str


@dataclass(frozen=True, slots=True)
class Guard:
    guard_ns: int


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class Failed:
    why: str


@dataclass(frozen=True, slots=True)
class Step:
    wire: tuple | None  # the step's digest as digest.step_wire built it; None: only outputs
    outputs: list[tuple]  # RequestOutput as plain tuples


@dataclass(frozen=True, slots=True)
class Idle:
    now_ns: int


@dataclass(frozen=True, slots=True)
class Verdict:
    state: DeviceState
    ratio: float  # the steps' median time over calibrated (0 when failed)
    why: str


@dataclass(frozen=True, slots=True)
class Stopped:
    pass


_STEP = Kind.STEP.value  # a plain str, as every kind travels: the tuple pickles as it always did
Message = Add | Cancel | Guard | Stop | Ready | Failed | Step | Idle | Verdict | Stopped


def encode(message: Message) -> tuple:
    """The message as the pipe's plain tuple: its kind's string, then its fields (a state as its string)."""
    if type(message) is Step:  # every step: first, and no match to walk
        return (_STEP, message.wire, message.outputs)
    match message:
        case Add(request):
            return (Kind.ADD.value, request)
        case Cancel(call_id):
            return (Kind.CANCEL.value, call_id)
        case Guard(guard_ns):
            return (Kind.GUARD.value, guard_ns)
        case Idle(now_ns):
            return (Kind.IDLE.value, now_ns)
        case Verdict(state, ratio, why):
            return (Kind.VERDICT.value, state.value, ratio, why)
        case Ready():
            return (Kind.READY.value, message)
        case Failed(why):
            return (Kind.FAILED.value, why)
        case Stop():
            return (Kind.STOP.value,)
        case Stopped():
            return (Kind.STOPPED.value,)
    raise TypeError(f"not a pipe message: {message!r}")


def decode(data: tuple) -> Message:
    """The typed message of a tuple that `encode` built."""
    kind, *fields = data
    if kind == _STEP:
        return Step(*fields)
    if kind == Kind.VERDICT:
        state, ratio, why = fields
        return Verdict(DeviceState(state), ratio, why)
    if kind == Kind.READY:
        return fields[0]
    return _DECODED[Kind(kind)](*fields)


_DECODED = {
    Kind.ADD: Add,
    Kind.CANCEL: Cancel,
    Kind.GUARD: Guard,
    Kind.STOP: Stop,
    Kind.FAILED: Failed,
    Kind.IDLE: Idle,
    Kind.STOPPED: Stopped,
}
