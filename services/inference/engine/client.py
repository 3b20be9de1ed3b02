"""The server process's side of the pipe: `EngineClient` (an `EngineHandle`, handle.py) starts the engine process
(core.py), sends it calls and relays each step's digest to the observers and its outputs to the calls' sinks, on
the event loop. The messages are messages.py's. No torch here.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import structlog

from services import errors

from ..sched.request import FinishReason, Request, RequestStatus
from .core import engine_main
from .digest import EndedRequest, StepDigest, StepObserver
from .engine import OutputSink, RequestOutput
from .handle import OnLost, OnVerdict
from .messages import (
    DEVICE_FAULT_EXIT,
    Add,
    Cancel,
    EngineFailed,
    EngineSpec,
    Guard,
    Idle,
    Message,
    Ready,
    Step,
    Stop,
    Verdict,
    decode,
    encode,
)

log = structlog.get_logger(__name__)


@dataclass
class _Tracked:
    sink: OutputSink
    num_prompt_tokens: int
    num_output_tokens: int = 0
    first_token_ns: int | None = None


@dataclass
class EngineClient:
    """The engine in a child process. `on_lost` is called (on the event loop) if the child dies while serving, and
    `on_verdict` with each of the child's watchdog verdicts."""

    spec: EngineSpec
    clock: Callable[[], int]
    on_lost: OnLost | None = None
    on_verdict: OnVerdict | None = None  # the watchdog's verdicts, on the loop
    observers: list[StepObserver] = field(default_factory=list)
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
            message = decode(self._from_engine.recv())
        except EOFError:
            raise EngineFailed(
                f"the engine process exited with code {self._process.exitcode} while warming up"
            ) from None
        if not isinstance(message, Ready):
            self._process.join(10)
            raise EngineFailed(f"the engine process could not start: {message.why}")
        return message

    @property
    def num_unfinished(self) -> int:
        return len(self._tracked)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def set_expiry_guard(self, guard_ns: int) -> None:
        self._send(Guard(guard_ns))

    def start(self) -> None:
        """Relays the child's messages on the running event loop from now on."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._from_engine.fileno(), self._drain)

    def add_request(self, request: Request, sink: OutputSink) -> None:
        try:
            self._send(Add(request))
        except OSError:  # the child died and the loop has not read its end yet
            raise errors.NotServing("the engine process is gone; try another replica", {"state": "failed"}) from None
        self._tracked[request.call_id] = _Tracked(sink, request.num_prompt_tokens)

    def cancel(self, call_id: str) -> None:
        try:
            self._send(Cancel(call_id))
        except OSError:  # nothing left to cancel: the loss ends every call the child had
            pass

    def stop(self, timeout_s: float = 10.0) -> None:
        """Blocking: call off the loop, which goes on relaying the last outputs meanwhile."""
        self._stopping = True
        if self._process is None:
            return
        try:
            self._send(Stop())
        except (BrokenPipeError, OSError):
            pass
        self._process.join(timeout_s)
        if self._process.is_alive():
            log.warning("engine_process_kill", pid=self._process.pid)
            self._process.kill()
            self._process.join(5)

    def _send(self, message: Message) -> None:
        # the C pickler, as the relay does: an admitted call spends this on its way to the very next step
        data = pickle.dumps(encode(message), pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._to_engine.send_bytes(data)

    def _drain(self) -> None:
        conn = self._from_engine
        try:
            while conn.poll():
                self._dispatch(decode(conn.recv()))
        except (EOFError, OSError):
            self._loop.remove_reader(conn.fileno())
            if not self._stopping:
                self._process.join(1)  # it has closed its end: it is exiting, and its status says why
                code = self._process.exitcode
                self._lose(
                    f"the engine process exited with code {code}"
                    + (" after a device fault" if code == DEVICE_FAULT_EXIT else "")
                )

    def _dispatch(self, message: Message) -> None:
        match message:
            case Step(wire, outputs):
                if wire is not None:
                    digest = StepDigest.from_wire(wire)
                    for observer in self.observers:
                        observer.on_step(digest)
                self._relay([RequestOutput._make(o) for o in outputs])
            case Idle(now_ns):
                for observer in self.observers:
                    observer.on_idle(now_ns)
            case Verdict(state, ratio, why) if self.on_verdict is not None:
                self.on_verdict(state, ratio, why)

    def _relay(self, outputs: Sequence[RequestOutput]) -> None:
        for output in outputs:
            tracked = self._tracked.get(output.call_id)
            if tracked is None:
                continue
            tracked.num_output_tokens = output.num_output_tokens
            if output.token_ids and tracked.first_token_ns is None:
                tracked.first_token_ns = output.time_ns
            if output.finish_reason is not None:
                del self._tracked[output.call_id]
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
        error = FinishReason.ERROR
        self._relay([RequestOutput(e.call_id, (), "", now_ns, e.num_output_tokens, error) for e in ended])
        if self.on_lost is not None:
            self.on_lost(why)
