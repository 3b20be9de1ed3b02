"""The engine in its own process: same tokens as in a thread, and a dead engine fails its calls precisely,
bills what they used, and takes the replica out of service."""

from __future__ import annotations

import os
import pickle
import signal
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from zeroqueue.inference.v1 import inference_pb2 as pb

from services import errors
from services.inference.device.cpus import engine_threads, pin, split_cpus
from services.inference.device.executor import Executor, ExecutorConfig
from services.inference.device.loader import load_checkpoint
from services.inference.engine.client import EngineClient
from services.inference.engine.core import Relay
from services.inference.engine.digest import Observers, StepDigest
from services.inference.engine.engine import Engine
from services.inference.engine.messages import DEVICE_FAULT_EXIT, EngineFailed, EngineSpec
from services.inference.sched.request import Request, RequestStatus, SamplingParams
from services.inference.serve_config import ServeConfig
from tests.inference.harness import ServerThread, status_details
from tests.inference.test_usage import ledger_rows

PROMPT = "def add(a, b):\n    return"


def serve(llama_dir, engine_process, **config):
    cfg = ServeConfig(
        str(llama_dir),
        port=0,
        engine_process=engine_process,
        executor=ExecutorConfig(max_batch=4, max_seq_len=256),
        **config,
    )
    return ServerThread(cfg).start()


def greedy(server, **fields):
    messages = list(server.stub().Generate(pb.GenerateRequest(prompt=PROMPT, temperature=0.0, **fields), timeout=30))
    return [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids], messages[-1].final


def test_engine_process_streams_the_same_tokens_as_the_engine_thread(llama_dir):
    threaded = serve(llama_dir, engine_process=False)
    try:
        expected, _ = greedy(threaded, max_tokens=24)
    finally:
        threaded.stop()
    server = serve(llama_dir, engine_process=True)
    try:
        assert isinstance(server.replica.engine, EngineClient) and server.replica.engine.pid != os.getpid()
        tokens, final = greedy(server, max_tokens=24)
        assert tokens == expected and len(tokens) > 0
        assert final.usage.sm_us > 0 and final.timings.queue_us >= 0
        assert final.timings.first_scheduled_at_us >= final.timings.received_at_us
        # Ctrl-C in a terminal reaches the whole process group: the server, not the signal, stops the engine
        os.kill(server.replica.engine.pid, signal.SIGINT)
        os.kill(server.replica.engine.pid, signal.SIGTERM)
        time.sleep(0.2)
        assert greedy(server, max_tokens=24)[0] == expected
    finally:
        server.stop()


def _health(server, name="zeroqueue.inference.v1.Inference"):
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))
    return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status


def test_a_killed_engine_fails_its_calls_bills_them_and_takes_the_replica_out(llama_dir):
    server = serve(llama_dir, engine_process=True)
    try:
        call = server.stub().Generate(
            pb.GenerateRequest(prompt=PROMPT, max_tokens=200, request_id="doomed", temperature=0.0), timeout=30
        )
        next(call)  # admitted
        next(call)  # and running: a token came back
        os.kill(server.replica.engine.pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert status_details(info.value)["ErrorInfo"].reason == "ENGINE_FAILURE"
        pool = server.replica.service.kv.pool  # deadline admission's: the failed call's blocks are back
        assert pool.num_used == 0 and pool.num_free == pool.num_blocks
        deadline = time.monotonic() + 5
        while _health(server) != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _health(server) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert _health(server, "liveness") == health_pb2.HealthCheckResponse.NOT_SERVING  # restart the pod
        with pytest.raises(grpc.RpcError) as refused:
            list(server.stub().Generate(pb.GenerateRequest(prompt="x", max_tokens=2), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert status_details(refused.value)["ErrorInfo"].reason == "NOT_SERVING"
        (model,) = server.stub().ListModels(pb.ListModelsRequest(), timeout=5).models
        assert model.state == pb.WARMUP_STATE_FAILED
    finally:
        server.stop(grace_s=1)
    (row,) = ledger_rows(
        server.config.ledger_url,
        "SELECT outcome, unit_us, completion_tokens FROM usage_records WHERE request_id = 'doomed'",
    )
    assert row.outcome == "error" and row.unit_us > 0 and row.completion_tokens >= 1


def failing_executor(checkpoint, config):
    raise RuntimeError("no device here")


def test_an_engine_that_cannot_start_says_why(llama_dir):
    spec = EngineSpec(
        str(llama_dir), "auto", ExecutorConfig(max_batch=2, max_seq_len=64), 64, make_executor=failing_executor
    )
    with pytest.raises(EngineFailed, match="RuntimeError: no device here"):
        EngineClient(spec, time.monotonic_ns).launch()


def test_a_call_admitted_as_the_engine_dies_is_refused_as_not_serving(llama_dir):
    spec = EngineSpec(str(llama_dir), "auto", ExecutorConfig(max_batch=2, max_seq_len=64), 64, calibrate=False)
    client = EngineClient(spec, time.monotonic_ns)
    client.launch()
    os.kill(client.pid, signal.SIGKILL)
    client._process.join(10)
    request = Request("late", (1, 2, 3), SamplingParams(max_tokens=2), time.monotonic_ns())
    with pytest.raises(errors.NotServing):
        client.add_request(request, sink=None)
    assert client.num_unfinished == 0  # nothing is tracked for a call the engine never got
    client.cancel("late")  # and cancelling into a dead engine is harmless


class _Pipe:
    def __init__(self) -> None:
        self.messages: list[tuple] = []

    def send_bytes(self, data: bytes) -> None:
        self.messages.append(pickle.loads(data))


class BothWays(Relay):
    """A step sink that builds each step's digest as the thread layout does (for its observers) and as the engine
    process ships it (the wire form into the relay), from the same report."""

    def __init__(self, conn, observers) -> None:
        super().__init__(conn)
        self.local = Observers(observers)

    def report(self, report, num_free_slots: int) -> None:
        self.local.report(report, num_free_slots)
        super().report(report, num_free_slots)


def test_the_digest_the_engine_process_ships_is_the_one_the_thread_layout_builds(llama_dir):
    checkpoint = load_checkpoint(llama_dir)
    executor = Executor(checkpoint, ExecutorConfig(max_batch=4, max_seq_len=256))
    digests: list[StepDigest] = []
    pipe = _Pipe()
    relay = BothWays(pipe, [type("Keep", (), {"on_step": lambda self, d: digests.append(d)})()])
    engine = Engine(executor, checkpoint.tokenizer, checkpoint.eos_token_ids, max_num_batched_tokens=40, sink=relay)
    now = time.monotonic_ns()
    # a prompt longer than the step's token budget (chunked), short ones that finish, one cancelled mid-way
    engine.add_request(Request("long", tuple(range(1, 70)), SamplingParams(max_tokens=3, temperature=0.0), now), relay)
    for i in range(3):
        engine.add_request(
            Request(f"short-{i}", (5, 6, 7), SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True), now),
            relay,
        )
    engine.step()
    engine.cancel("short-2")
    while engine.has_work:
        engine.step()
    shipped = [StepDigest.from_wire(m[1]) for m in pipe.messages if m[1] is not None]
    assert shipped == digests
    work = [w for d in digests for w in d.work]
    assert len([n for rid, n in work if rid == "long" and n > 1]) >= 2  # the prompt ran in chunks
    ended = {e.call_id: e.status for d in digests for e in d.ended}
    assert ended["short-2"] is RequestStatus.FINISHED_CANCELLED and ended["short-0"].is_finished
    assert sum(n for rid, n in work if rid == "long") == 69 + 3 - 1  # prompt, then one decode per later token


def test_split_cpus_gives_the_engine_the_last_cores_and_the_server_the_rest():
    assert split_cpus((0, 1), engine_threads(0, (0, 1))) == ((1,), (0,))
    assert split_cpus((3, 0, 2, 1), engine_threads(0, (0, 1, 2, 3))) == ((1, 2, 3), (0,))
    assert split_cpus((0, 1, 2, 3), engine_threads(2, (0, 1, 2, 3))) == ((2, 3), (0, 1))
    assert split_cpus((5,), engine_threads(0, (5,))) is None  # one core: nothing to keep apart
    assert split_cpus((0, 1), 2) is None


def thread_affinity(tid: int, if_gone: set[int]) -> set[int]:
    try:
        return os.sched_getaffinity(tid)
    except ProcessLookupError:  # the thread ended since it was listed
        return if_gone


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning keeps cores apart: needs two")
def test_a_pinned_engine_process_runs_on_its_own_cores_and_the_server_on_the_others(llama_dir):
    mask = os.sched_getaffinity(0)
    engine_cores, server_cores = split_cpus(tuple(mask), engine_threads(0, tuple(mask)))
    server = serve(llama_dir, engine_process=True, pin_cpus=True)
    try:
        assert os.sched_getaffinity(server.replica.engine.pid) == set(engine_cores)
        assert all(
            thread_affinity(int(tid), set(server_cores)) == set(server_cores) for tid in os.listdir("/proc/self/task")
        )
        tokens, final = greedy(server, max_tokens=8)
        assert len(tokens) == 8 and final.usage.sm_us > 0
    finally:
        server.stop()
        pin(mask)  # this test process hosted the server


class FaultyExecutor(Executor):
    """A CPU executor whose step fails like a GPU's: a sticky CUDA error for a call of 77 tokens, a plain
    failure for one of 78."""

    def run(self, step):
        asked = {s.request.sampling.max_tokens for s in (*step.decodes, *step.prefills)}
        if 77 in asked:
            raise torch.AcceleratorError("CUDA error: device-side assert triggered")
        if 78 in asked:
            raise RuntimeError("a failure that leaves the device usable")
        return super().run(step)


def _wait_for_health(server, status, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while _health(server) != status and time.monotonic() < deadline:
        time.sleep(0.01)
    return _health(server)


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_a_device_fault_ends_the_calls_bills_them_and_takes_the_replica_out(llama_dir, engine_process):
    server = ServerThread(
        ServeConfig(
            str(llama_dir), port=0, engine_process=engine_process, executor=ExecutorConfig(max_batch=4, max_seq_len=256)
        ),
        make_executor=FaultyExecutor,
    ).start()
    try:
        bystander = server.stub().Generate(
            pb.GenerateRequest(prompt=PROMPT, max_tokens=200, temperature=0.0, request_id="bystander"), timeout=30
        )
        next(bystander)
        next(bystander)  # running: a token came back
        with pytest.raises(grpc.RpcError) as faulted:
            list(
                server.stub().Generate(
                    pb.GenerateRequest(prompt=PROMPT, max_tokens=77, request_id="faulty"), timeout=30
                )
            )
        with pytest.raises(grpc.RpcError) as lost:
            list(bystander)
        for error in (faulted.value, lost.value):
            assert error.code() == grpc.StatusCode.INTERNAL
            assert status_details(error)["ErrorInfo"].reason == "ENGINE_FAILURE"
        assert (
            _wait_for_health(server, health_pb2.HealthCheckResponse.NOT_SERVING)
            == health_pb2.HealthCheckResponse.NOT_SERVING
        )
        assert _health(server, "liveness") == health_pb2.HealthCheckResponse.NOT_SERVING  # restart the pod
        if engine_process:
            server.replica.engine._process.join(10)
            assert server.replica.engine._process.exitcode == DEVICE_FAULT_EXIT
        with pytest.raises(grpc.RpcError) as refused:
            list(server.stub().Generate(pb.GenerateRequest(prompt="x", max_tokens=2), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace_s=1)
    rows = ledger_rows(server.config.ledger_url, "SELECT request_id, outcome FROM usage_records ORDER BY request_id")
    assert [(r.request_id, r.outcome) for r in rows] == [("bystander", "error"), ("faulty", "error")]


def test_a_step_that_fails_without_a_device_fault_leaves_the_replica_serving(llama_dir):
    server = ServerThread(
        ServeConfig(str(llama_dir), port=0, executor=ExecutorConfig(max_batch=4, max_seq_len=256)),
        make_executor=FaultyExecutor,
    ).start()
    try:
        with pytest.raises(grpc.RpcError) as failed:
            list(server.stub().Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=78), timeout=30))
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert _health(server) == health_pb2.HealthCheckResponse.SERVING
        tokens, final = greedy(server, max_tokens=8)
        assert len(tokens) == 8 and final.finish_reason == pb.FINISH_REASON_LENGTH
        assert server.replica.engine._process.is_alive()
    finally:
        server.stop(grace_s=1)


def test_every_pipe_message_is_its_plain_tuple_and_back():
    from services.inference.engine.messages import (
        Add,
        Cancel,
        Failed,
        Guard,
        Idle,
        Step,
        Stop,
        Stopped,
        Verdict,
        decode,
        encode,
    )
    from services.inference.health.state import DeviceState

    request = Request("c1", (1, 2), SamplingParams(max_tokens=2), 0)
    wire = (1, 2, True, ("c1",), (), 3, (), 1, 0, 0)
    expected = [
        (Add(request), ("add", request)),
        (Cancel("c1"), ("cancel", "c1")),
        (Guard(5), ("guard", 5)),
        (Stop(), ("stop",)),
        (Failed("why"), ("failed", "why")),
        (Step(wire, [("c1", (7,), "x", 4, 1, None, 0)]), ("step", wire, [("c1", (7,), "x", 4, 1, None, 0)])),
        (Idle(9), ("idle", 9)),
        (Verdict(DeviceState.SLOW, 1.5, "slow steps"), ("device", "slow", 1.5, "slow steps")),
        (Stopped(), ("stopped",)),
    ]
    for message, plain in expected:
        assert encode(message) == plain and type(encode(message)[0]) is str  # the pipe carries plain strings
        assert decode(encode(message)) == message
