"""The engine in its own process, as vLLM v1 runs its EngineCore.

The engine's Python (scheduling, sampling, detokenizing and the glue of hundreds of small torch ops per step)
holds a GIL. On the server's thread it held the event loop's GIL too, so an arriving call's admission waited
behind a step. Here the child process loads the checkpoint, warms up, calibrates and runs the step loop; the
server process keeps the event loop, admission and the meter. Per step, one message comes back: the step's
digest and its outputs, in that order, so the meter sees usage before any final message is relayed.

Pipes: server -> engine carries ("add", Request), ("cancel", request_id), ("stop",); engine -> server carries
("ready", Ready), ("failed", text) before ready, then ("step", step_wire | None, [RequestOutput tuple]),
("idle", now_ns) and ("stopped",).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

import structlog

from services import errors
from services.logs import configure_logging

from .calibration import calibrate
from .costmodel import CostModel
from .cpus import pin
from .digest import EndedRequest, StepDigest, step_wire
from .engine import Engine, OutputSink, RequestOutput, StepObserver
from .executor import DeviceInfo, Executor, ExecutorConfig
from .loader import Checkpoint, load_checkpoint
from .pacing import Pacer
from .request import Request, RequestStatus

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """Everything the child needs to build the engine; picklable."""

    model_dir: str
    dtype: str
    executor: ExecutorConfig
    max_num_batched_tokens: int
    calibrate: bool = True
    make_executor: Callable[..., Executor] = Executor  # a module-level callable: it crosses by reference
    json_logs: bool | None = None  # configure structlog like the server (None: leave it)
    cpus: tuple[int, ...] = ()  # the cores the engine process runs on (empty: any)
    pace_tokens: int = 0  # paced steps (pacing.py) with this chunk; 0: unpaced


@dataclass(frozen=True)
class Ready:
    info: DeviceInfo
    num_slots: int
    max_seq_len: int
    max_num_batched_tokens: int
    cost_rows: tuple[int, ...] = ()  # the calibrated cost model, empty without calibration
    cost_row_us: tuple[float, ...] = ()
    cost_us_per_context_token: float = 0.0


DEVICE_FAULT_EXIT = 3  # the child's exit status after a device fault


class EngineFailed(RuntimeError):
    """The engine process could not start (it names why) or died."""


# ---------------------------------------------------------------- the child


class _Relay:
    """In the child: the sink of every request; ships each step's digest and outputs in one message."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.wire: tuple | None = None  # the step's digest (step_wire), set by the engine
        self.outputs: list[RequestOutput] = []

    def put(self, output: RequestOutput) -> None:
        self.outputs.append(output)

    def on_idle(self, now_ns: int) -> None:
        self.conn.send(("idle", now_ns))

    def flush(self) -> None:
        if self.wire is not None or self.outputs:
            # plain tuples and the C pickler: Connection.send's ForkingPickler (a Python subclass with its own
            # dispatch table) took twice as long, on every step; recv() on the other end reads either
            message = ("step", self.wire, [tuple(o) for o in self.outputs])
            self.conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
            self.wire, self.outputs = None, []


class RelayedEngine(Engine):
    """The engine as the child runs it: with a relay, each step's digest goes to it as its wire form, built
    straight from the step's report (the observers are in the server process), and the relay ships it with the
    step's outputs. Without one (the --engine-thread layout) it is a plain Engine."""

    relay: _Relay | None = None

    def step(self):
        report = super().step()
        if self.relay is not None:
            self.relay.flush()
        return report

    def _notify(self, report) -> None:
        if self.relay is None:
            super()._notify(report)
        else:
            self.relay.wire = step_wire(report, self.scheduler.num_free_slots)

    def fail_all(self) -> None:
        super().fail_all()
        if self.relay is not None:
            self.relay.flush()


def build_engine(spec: EngineSpec, checkpoint: Checkpoint | None = None) -> tuple[RelayedEngine, Ready]:
    """Loads (unless given the checkpoint), warms up and (unless told not to) calibrates an engine, in
    whichever process calls it."""
    if spec.pace_tokens and not spec.calibrate:
        raise ValueError("paced steps need the calibrated cost model (calibrate=True)")
    checkpoint = checkpoint or load_checkpoint(spec.model_dir, spec.dtype)
    executor = spec.make_executor(checkpoint, spec.executor)
    engine = RelayedEngine(
        executor, checkpoint.tokenizer, checkpoint.eos_token_ids, max_num_batched_tokens=spec.max_num_batched_tokens
    )
    ready = Ready(
        executor.info, executor.num_slots, executor.max_seq_len, engine.scheduler.config.max_num_batched_tokens
    )
    if spec.calibrate:
        cost = calibrate(engine)
        ready = replace(
            ready,
            cost_rows=tuple(cost.rows),
            cost_row_us=tuple(cost.row_us),
            cost_us_per_context_token=cost.us_per_context_token,
        )
        if spec.pace_tokens:  # a copy of the calibration, which the pacer scales by the steps it measures
            engine.pacer = Pacer(
                CostModel(list(cost.rows), list(cost.row_us), cost.us_per_context_token), spec.pace_tokens
            )
    return engine, ready


def engine_main(spec: EngineSpec, inbox: Connection, outbox: Connection) -> None:
    """The child's entry point: builds, says ready, then steps until told to stop or the server is gone."""
    # the server decides when the engine stops (after draining); a terminal's Ctrl-C or a group-wide SIGTERM
    # must not end the engine under calls the server is still finishing
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if spec.cpus:  # before the first parallel region: OpenMP's threads inherit the mask
        pin(spec.cpus)
    if spec.json_logs is not None:
        configure_logging(spec.json_logs)
    try:
        engine, ready = build_engine(spec)
    except Exception as exc:  # noqa: BLE001 - reported to the server, which names it and exits
        outbox.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    relay = _Relay(outbox)
    engine.relay = relay
    outbox.send(("ready", ready))
    _step_loop(engine, relay, inbox)
    outbox.send(("stopped",))


def _step_loop(engine: RelayedEngine, relay: _Relay, inbox: Connection) -> None:
    """One thread: before every step it takes whatever the server sent, so a call that arrived during a step
    joins the very next one (a receiving thread would first have to win the GIL from the stepping one)."""
    stopping = False
    while not (stopping and not engine.has_work):
        if not engine.has_work and not inbox.poll(engine.idle_tick_s):
            relay.on_idle(engine.clock())
            continue
        stopping = _take_messages(engine, relay, inbox) or stopping
        if engine.has_work:
            try:
                engine.pace(engine.step())
            except Exception as exc:  # noqa: BLE001 - a failed step must not kill the loop; its calls end with "error"
                if not engine.recover(exc):
                    # the calls' ends and usage are flushed; a CUDA context with a sticky error serves nothing
                    # more, so the process goes, the server goes NOT_SERVING and the pod restarts
                    os._exit(DEVICE_FAULT_EXIT)


def _take_messages(engine: RelayedEngine, relay: _Relay, inbox: Connection) -> bool:
    """Applies every message waiting in the pipe; True once the server asked the engine to stop."""
    stop = False
    try:
        while inbox.poll():
            kind, *args = inbox.recv()
            if kind == "add":
                engine.add_request(args[0], relay)
            elif kind == "cancel":
                engine.cancel(args[0])
            elif kind == "guard":
                engine.set_expiry_guard(args[0])
            elif kind == "stop":
                stop = True
    except (EOFError, OSError):  # the server is gone: nobody is left to stream to or to bill
        os._exit(0)
    return stop


# ---------------------------------------------------------------- the server side


@dataclass
class _Tracked:
    sink: OutputSink
    num_prompt_tokens: int
    num_output_tokens: int = 0
    first_token_ns: int | None = None


@dataclass
class EngineClient:
    """Stands in for `Engine` in the server process: the same add_request / cancel / observers, with the
    engine in a child process. `on_lost` is called (on the event loop) if the child dies while serving."""

    spec: EngineSpec
    clock: Callable[[], int]
    observers: list[StepObserver] = field(default_factory=list)
    on_lost: Callable[[str], None] | None = None
    _tracked: dict[str, _Tracked] = field(default_factory=dict)
    _process: multiprocessing.process.BaseProcess | None = None
    _to_engine: Connection | None = None
    _from_engine: Connection | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _send_lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: bool = False

    def launch(self) -> Ready:
        """Starts the child and waits until it has warmed up and calibrated (blocking: call off the loop)."""
        context = multiprocessing.get_context("spawn")  # never fork a process that runs gRPC threads
        engine_in, self._to_engine = context.Pipe(duplex=False)
        self._from_engine, engine_out = context.Pipe(duplex=False)
        self._process = context.Process(
            target=engine_main, args=(self.spec, engine_in, engine_out), name="zeroqueue-engine", daemon=True
        )
        self._process.start()
        engine_in.close()
        engine_out.close()
        try:
            kind, *rest = self._from_engine.recv()
        except EOFError:
            raise EngineFailed(
                f"the engine process exited with code {self._process.exitcode} while warming up"
            ) from None
        if kind != "ready":
            self._process.join(10)
            raise EngineFailed(f"the engine process could not start: {rest[0]}")
        return rest[0]

    @property
    def num_unfinished(self) -> int:
        return len(self._tracked)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def set_expiry_guard(self, guard_ns: int) -> None:
        self._send(("guard", guard_ns))

    def start(self) -> None:
        """Relays the child's messages on the running event loop from now on."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._from_engine.fileno(), self._drain)

    def add_request(self, request: Request, sink: OutputSink) -> None:
        try:
            self._send(("add", request))
        except OSError:  # the child died and the loop has not read its end yet
            raise errors.NotServing("the engine process is gone; try another replica", {"state": "failed"}) from None
        self._tracked[request.request_id] = _Tracked(sink, request.num_prompt_tokens)

    def cancel(self, request_id: str) -> None:
        try:
            self._send(("cancel", request_id))
        except OSError:  # nothing left to cancel: the loss ends every call the child had
            pass

    def stop(self, timeout_s: float = 10.0) -> None:
        """Blocking: call off the loop, which goes on relaying the last outputs meanwhile."""
        self._stopping = True
        if self._process is None:
            return
        try:
            self._send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self._process.join(timeout_s)
        if self._process.is_alive():
            log.warning("engine_process_kill", pid=self._process.pid)
            self._process.kill()
            self._process.join(5)

    def _send(self, message: tuple) -> None:
        # the C pickler, as the relay does: an admitted call spends this on its way to the very next step
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._to_engine.send_bytes(data)

    def _drain(self) -> None:
        conn = self._from_engine
        try:
            while conn.poll():
                self._dispatch(conn.recv())
        except (EOFError, OSError):
            self._loop.remove_reader(conn.fileno())
            if not self._stopping:
                self._process.join(1)  # it has closed its end: it is exiting, and its status says why
                code = self._process.exitcode
                self._lose(
                    f"the engine process exited with code {code}"
                    + (" after a device fault" if code == DEVICE_FAULT_EXIT else "")
                )

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, wire, outputs = message
            if wire is not None:
                digest = StepDigest.from_wire(wire)
                for observer in self.observers:
                    observer.on_step(digest)
            self._relay([RequestOutput._make(o) for o in outputs])
        elif kind == "idle":
            for observer in self.observers:
                observer.on_idle(message[1])

    def _relay(self, outputs: Sequence[RequestOutput]) -> None:
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            tracked.num_output_tokens = output.num_output_tokens
            if output.token_ids and tracked.first_token_ns is None:
                tracked.first_token_ns = output.time_ns
            if output.finish_reason is not None:
                del self._tracked[output.request_id]
            tracked.sink.put(output)

    def _lose(self, why: str) -> None:
        """The child died: its requests end with "error", billed for what the meter saw, as in-thread."""
        log.error("engine_process_lost", why=why, in_flight=len(self._tracked))
        now_ns = self.clock()
        ended = tuple(
            EndedRequest(rid, RequestStatus.FINISHED_ERROR, t.num_prompt_tokens, t.num_output_tokens, t.first_token_ns)
            for rid, t in self._tracked.items()
        )
        digest = StepDigest(now_ns, now_ns, False, (), 0, ended, 0, 0)
        for observer in self.observers:
            observer.on_step(digest)
        self._relay([RequestOutput(e.request_id, (), "", now_ns, e.num_output_tokens, "error") for e in ended])
        if self.on_lost is not None:
            self.on_lost(why)
