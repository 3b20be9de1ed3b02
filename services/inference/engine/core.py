"""The engine process's side of the pipe, as vLLM v1 runs its EngineCore: the child's loop.

The engine's Python (scheduling, sampling, detokenizing and the glue of hundreds of small torch ops per step)
holds a GIL. On the server's thread it held the event loop's GIL too, so an arriving call's admission waited
behind a step. Here the child process loads the checkpoint, warms up, calibrates and runs the step loop; the
server process (client.py) keeps the event loop, admission and the meter. Per step, one message comes back: the
step's digest and its outputs, in that order, so the meter sees usage before any final message is relayed. The
messages are messages.py's. Torch is imported only when the engine is built.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import structlog

from services.logs import configure_logging

from ..chat import ChatTemplate, stop_token_ids
from ..cost.model import CostModel
from ..device.cpus import allowed_cpus, engine_threads, pin, split_cpus
from ..grammar import GrammarLimits
from ..health.faults import Fault, FaultyExecutor
from ..health.state import DeviceState
from ..health.watchdog import Watchdog, WatchedExecutor, probe_us
from .calibration import calibrate
from .digest import StepReport, StepSink, step_wire
from .engine import Engine, RequestOutput
from .grammars import GrammarBook
from .messages import (
    DEVICE_FAULT_EXIT,
    Add,
    Cancel,
    EngineSpec,
    Failed,
    Guard,
    Idle,
    Message,
    Ready,
    Step,
    Stop,
    Stopped,
    Verdict,
    decode,
    encode,
)
from .pacing import Pacer

if TYPE_CHECKING:
    from ..device.loader import Checkpoint

log = structlog.get_logger(__name__)


class Relay:
    """In the child: the engine's step sink and the output sink of every request; ships each step's digest (its
    wire form, built straight from the step's report: the observers are in the server process) and its outputs
    in one message."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.wire: tuple | None = None  # the step's digest (step_wire), set by report()
        self.outputs: list[RequestOutput] = []
        self._send_lock = threading.Lock()  # the watchdog's thread sends too

    def send(self, message: Message) -> None:
        # plain tuples and the C pickler: Connection.send's ForkingPickler (a Python subclass with its own
        # dispatch table) took twice as long, on every step; recv() on the other end reads either
        data = pickle.dumps(encode(message), pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(data)

    def put(self, output: RequestOutput) -> None:
        self.outputs.append(output)

    def report(self, report: StepReport, num_free_slots: int) -> None:
        self.wire = step_wire(report, num_free_slots)

    def on_idle(self, now_ns: int) -> None:
        self.send(Idle(now_ns))

    def verdict(self, state: DeviceState, ratio: float, why: str) -> None:
        self.send(Verdict(state, ratio, why))

    def flush(self) -> None:
        if self.wire is not None or self.outputs:
            self.send(Step(self.wire, [tuple(o) for o in self.outputs]))
            self.wire, self.outputs = None, []


def build_engine(
    spec: EngineSpec,
    sink: StepSink | None = None,
    on_verdict: Callable[[DeviceState, float, str], None] | None = None,
    on_lost: Callable[[str], None] | None = None,
    checkpoint: Checkpoint | None = None,
) -> tuple[Engine, Ready]:
    """Loads (unless given the checkpoint), warms up and (unless told not to) calibrates an engine, in
    whichever process calls it: the engine process, or with --engine-thread the server's. Torch comes in here,
    with the executor and the checkpoint's weights. Calibration runs on an engine of its own; the one returned is
    built whole, with what calibration tells (the pacer, the watched executor, an injected fault armed from now
    on): its steps go to `sink` (None: its observers), the watchdog's verdicts to `on_verdict` (from the
    watchdog's thread or the engine's), and a device fault that stops its thread to `on_lost`."""
    from ..device.executor import Executor
    from ..device.loader import load_checkpoint

    if spec.pace_tokens and not spec.calibrate:
        raise ValueError("paced steps need the calibrated cost model (calibrate=True)")
    checkpoint = checkpoint or load_checkpoint(spec.model_dir, spec.dtype)
    executor = (spec.make_executor or Executor)(checkpoint, spec.executor)

    tokenizer, eos = checkpoint.tokenizer, checkpoint.eos_token_ids
    chat = ChatTemplate.from_dir(checkpoint.path)
    # a grammar's output may end where a chat turn ends, as well as at end-of-sequence
    grammar_stops = (*eos, *(stop_token_ids(chat, tokenizer) if chat is not None else ()))

    def make_engine(executor, **serving) -> Engine:
        grammars = GrammarBook(tokenizer, grammar_stops, GrammarLimits())
        return Engine(
            executor,
            tokenizer,
            eos,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            grammars=grammars,
            earliest_deadline_first=spec.earliest_deadline_first,
            **serving,
        )

    warming = make_engine(executor)
    ready = Ready(
        executor.info,
        executor.num_slots,
        executor.max_seq_len,
        warming.scheduler.config.max_num_batched_tokens,
        num_kv_blocks=executor.num_blocks,
        kv_block_size=executor.block_size,
        weight_dtype=executor.weight_dtype,
    )
    cost, pacer, step_cost = None, None, None
    if spec.calibrate:
        cost = calibrate(warming)
        ready, step_cost, pacer = _calibrated(ready, cost, spec.pace_tokens)
    watchdog = None
    if spec.watchdog is not None and cost is not None:
        expected_probe_us = probe_us(executor)  # on the device as calibrated, before any fault
        watchdog = Watchdog(spec.watchdog, on_verdict or _unheard)
        executor = WatchedExecutor(_faulty(executor, spec.fault), watchdog, cost, expected_probe_us)
    else:
        executor = _faulty(executor, spec.fault)
    warming.grammars.close()  # its compiles were calibration's
    engine = make_engine(executor, sink=sink, pacer=pacer, watchdog=watchdog, on_lost=on_lost, step_cost=step_cost)
    if watchdog is not None:
        watchdog.start()
    return engine, ready


def _calibrated(ready: Ready, cost: CostModel, pace_tokens: int) -> tuple[Ready, CostModel, Pacer | None]:
    """What calibration tells the server (`ready` with the cost model's fit), the engine's own copy of the cost
    model (its running ratio, learnt from the engine's steps, forecasts each step for expiry), and the pacer where
    steps are paced (a copy of the calibration, which it scales by the steps it measures)."""
    ready = replace(
        ready,
        cost_rows=tuple(cost.rows),
        cost_row_us=tuple(cost.row_us),
        cost_us_per_context_token=cost.us_per_context_token,
        cost_us_per_masked_row=cost.us_per_masked_row,
        cost_us_per_logprob_row=cost.us_per_logprob_row,
        cost_us_per_prefill_context_token=cost.us_per_prefill_context_token,
    )
    step_cost = CostModel(
        list(cost.rows),
        list(cost.row_us),
        cost.us_per_context_token,
        us_per_prefill_context_token=cost.us_per_prefill_context_token,
    )
    pacer = None
    if pace_tokens:
        pacer = Pacer(CostModel(list(cost.rows), list(cost.row_us), cost.us_per_context_token), pace_tokens)
    return ready, step_cost, pacer


def _unheard(state: DeviceState, ratio: float, why: str) -> None:
    """No one listens for verdicts: the watchdog logs each one anyway."""


def _faulty(executor, fault: Fault | None):
    """The executor with `fault` (if any), armed now: its clock starts once the engine is warm and calibrated."""
    if fault is None:
        return executor
    faulty = FaultyExecutor(executor, fault)
    faulty.arm()
    log.warning("fault_injected", fault=str(fault))
    return faulty


def _pin_engine(spec: EngineSpec) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """With pin_cpus, a CPU engine runs on cores of its own, when there is a core to spare for the server:
    (engine cores, server cores), or None."""
    from ..device.executor import runs_on_cpu

    if not (spec.pin_cpus and runs_on_cpu(spec.executor)):
        return None
    allowed = allowed_cpus()
    split = split_cpus(allowed, engine_threads(spec.executor.num_threads, allowed))
    if split is not None:
        pin(split[0])
    return split


def engine_main(spec: EngineSpec, inbox: Connection, outbox: Connection) -> None:
    """The child's entry point: builds, says ready, then steps until told to stop or the server is gone."""
    # the server decides when the engine stops (after draining); a terminal's Ctrl-C or a group-wide SIGTERM
    # must not end the engine under calls the server is still finishing
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(bool(spec.json_logs))  # a spawned child starts with structlog's defaults: stdout, colours
    relay = Relay(outbox)
    try:
        split = _pin_engine(spec)  # before the first parallel region: OpenMP's threads inherit the mask
        engine, ready = build_engine(spec, sink=relay, on_verdict=relay.verdict)
    except Exception as exc:  # noqa: BLE001 - reported to the server, which names it and exits
        relay.send(Failed(f"{type(exc).__name__}: {exc}"))
        return
    if split is not None:
        ready = replace(ready, engine_cpus=split[0], server_cpus=split[1])
    relay.send(ready)
    _step_loop(engine, relay, inbox)
    relay.send(Stopped())


def _step_loop(engine: Engine, relay: Relay, inbox: Connection) -> None:
    """One thread: before every step it takes whatever the server sent, so a call that arrived during a step
    joins the very next one (a receiving thread would first have to win the GIL from the stepping one)."""
    stopping = False
    while not (stopping and not engine.has_work):
        if not engine.has_work and not inbox.poll(engine.idle_wait_s):
            _guarded(engine, engine.idle)  # a probe of the watched device, and idle time for the meter
            continue
        stopping = _take_messages(engine, relay, inbox) or stopping
        if engine.has_work:
            _guarded(engine, lambda: engine.pace(engine.step()))


def _guarded(engine: Engine, operation: Callable[[], None]) -> None:
    """Runs a device operation; a failure must not kill the loop (the step's calls end with "error")."""
    try:
        operation()
    except Exception as exc:  # noqa: BLE001 - reported by recover(), which ends the calls
        if not engine.recover(exc):
            # the calls' ends and usage are flushed; a CUDA context with a sticky error serves nothing more, so
            # the process goes, the server goes NOT_SERVING and the pod restarts
            os._exit(DEVICE_FAULT_EXIT)


def _take_messages(engine: Engine, relay: Relay, inbox: Connection) -> bool:
    """Applies every message waiting in the pipe; True once the server asked the engine to stop."""
    stop = False
    try:
        while inbox.poll():
            match decode(inbox.recv()):
                case Add(request):
                    engine.add_request(request, relay)
                case Cancel(call_id):
                    engine.cancel(call_id)
                case Guard(guard_ns):
                    engine.set_expiry_guard(guard_ns)
                case Stop():
                    stop = True
    except (EOFError, OSError):  # the server is gone: nobody is left to stream to or to bill
        os._exit(0)
    return stop
