"""Admission under load, on a replica whose steps take a known minimum time (a fake slow device)."""

from __future__ import annotations

import collections
import json
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc

from services.inference.device.executor import ExecutorConfig
from services.inference.serve_config import ServeConfig
from tests.inference.harness import ServerThread, status_details

STEP_S = 0.02
# the one copy of the recommended service config (README.md and docs/OPERATIONS.md point to it)
SERVICE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "grpc-service-config.json"


def start_slow_server(llama_dir, max_batch=2, **config):
    # the engine on a thread of this process, so a test can slow its device down mid-call
    config.setdefault("engine_process", False)
    cfg = ServeConfig(str(llama_dir), port=0, executor=ExecutorConfig(max_batch=max_batch, max_seq_len=256), **config)
    return ServerThread(cfg, step_floor_s=STEP_S).start()


@pytest.fixture(scope="module")
def server(llama_dir):
    s = start_slow_server(llama_dir, hold=False)  # refusals and their hints: a call that fits later is not held
    yield s
    s.stop()


def metric(server, name, **labels):
    value = server.replica.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def refusals_by_cause(server) -> collections.Counter:
    """zeroqueue_refusals_total summed over tenants, by cause."""
    counts = collections.Counter()
    for family in server.replica.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "zeroqueue_refusals_total":
                counts[sample.labels["cause"]] += int(sample.value)
    return counts


class Background:
    """A streaming call consumed on a thread, remembering when each message arrived."""

    def __init__(self, stub, timeout=20, **fields) -> None:
        self.messages, self.times, self.error = [], [], None
        self.admitted = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(stub, timeout, fields), daemon=True)
        self.thread.start()

    def _run(self, stub, timeout, fields):
        try:
            for message in stub.Generate(pb.GenerateRequest(**fields), timeout=timeout):
                self.messages.append(message)
                self.times.append(time.monotonic())
                self.admitted.set()
        except grpc.RpcError as error:
            self.error = error
            self.admitted.set()

    def join(self):
        self.thread.join(60)
        return self


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert predicate()


def fill(server, n=2, max_tokens=40):
    calls = [Background(server.stub(), prompt="def f(x):", max_tokens=max_tokens, temperature=0.0) for _ in range(n)]
    for c in calls:
        assert c.admitted.wait(20) and c.error is None
    return calls


def test_full_batch_rejects_at_once_with_a_retry_delay_and_the_retry_succeeds(server):
    running = fill(server)
    refusals_timed = metric(server, "zeroqueue_refusal_reply_seconds_count")
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(
            server.stub().Generate(pb.GenerateRequest(prompt="x = 1", max_tokens=20, request_id="retry-me"), timeout=5)
        )
    rejected_at = time.monotonic()
    error = info.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = status_details(error)
    assert details["ErrorInfo"].reason == "OVERLOADED"
    assert metric(server, "zeroqueue_refusal_reply_seconds_count") == refusals_timed + 1
    retry_ms = details["RetryInfo"].retry_delay.ToMilliseconds()
    trailing = dict(error.trailing_metadata())
    assert int(trailing["retry-after-ms"]) == retry_ms == int(trailing["grpc-retry-pushback-ms"])
    assert abs(int(trailing["x-server-time"]) / 1e6 - time.time()) < 5
    # refused without waiting for capacity: both running calls were still streaming
    assert all(not c.thread.is_alive() or len(c.messages) < 42 for c in running)
    assert all(c.times[-1] > rejected_at for c in [c.join() for c in running] if c.times)
    # the hint is when the first running call is predicted to finish: about 40 steps away
    assert 10 * STEP_S * 1000 <= retry_ms <= 40 * STEP_S * 1000 * 4
    time.sleep(max(retry_ms / 1000 - (time.monotonic() - t0), 0))
    messages = list(
        server.stub().Generate(pb.GenerateRequest(prompt="x = 1", max_tokens=20, request_id="retry-me"), timeout=5)
    )
    assert messages[-1].final.timings.deadline_met


def test_grpc_retry_policy_waits_the_pushback_delay(server):
    running = fill(server)
    # the documented service config (its 25 ms initial backoff is far below the hint), in a C-core channel
    config = json.loads(SERVICE_CONFIG.read_text())
    channel = server.channel(**{"grpc.service_config": json.dumps(config), "grpc.enable_retries": 1})
    before_retry = metric(server, "zeroqueue_retry_attempts_total", attempt="1", result="admitted") + metric(
        server, "zeroqueue_retry_attempts_total", attempt="1", result="overloaded"
    )
    before_first = metric(server, "zeroqueue_retry_attempts_total", attempt="0", result="overloaded")
    before_causes = refusals_by_cause(server)
    t0 = time.monotonic()
    messages = list(
        inference_pb2_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(prompt="y = 2", max_tokens=10, request_id="policy-retry"), timeout=10
        )
    )
    elapsed = time.monotonic() - t0
    assert messages[-1].WhichOneof("kind") == "final"
    assert metric(server, "zeroqueue_retry_attempts_total", attempt="0", result="overloaded") == before_first + 1
    after_retry = metric(server, "zeroqueue_retry_attempts_total", attempt="1", result="admitted") + metric(
        server, "zeroqueue_retry_attempts_total", attempt="1", result="overloaded"
    )
    assert after_retry == before_retry + 1, "the server saw grpc-previous-rpc-attempts: 1"
    causes = refusals_by_cause(server) - before_causes
    assert causes["slots_full"] >= 1 and set(causes) <= {"slots_full", "step_budget"}, causes
    assert elapsed >= 10 * STEP_S, "the client waited the pushback, not the 10 ms backoff"
    for c in running:
        c.join()


def test_mispredicted_request_ends_with_deadline_exceeded_and_frees_its_slot(llama_dir):
    s = start_slow_server(llama_dir)
    try:
        engine = s.replica.engine.engine  # the Engine inside the thread handle
        misses = metric(s, "zeroqueue_deadline_misses_total")
        call = Background(s.stub(), timeout=3, prompt="def g():", max_tokens=60, temperature=0.0)
        assert call.admitted.wait(10) and call.error is None
        device = engine.executor.executor  # the slow executor, beneath the watchdog's timing
        device.floor_s = 0.25  # the device becomes ten times slower than calibrated
        call.join()
        assert call.error is not None and call.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert status_details(call.error)["ErrorInfo"].reason == "DEADLINE_MISSED"
        device.floor_s = STEP_S
        assert engine.scheduler.num_free_slots == device.num_slots
        wait_until(lambda: not s.replica.service.in_flight)
        assert metric(s, "zeroqueue_deadline_misses_total") == misses + 1
        assert metric(s, "zeroqueue_requests_total", outcome="deadline_exceeded") == 1
    finally:
        s.stop()


def test_health_goes_serving_after_warm_up_and_not_serving_on_drain(llama_dir):
    cfg = ServeConfig(str(llama_dir), port=0, executor=ExecutorConfig(max_batch=2, max_seq_len=256))
    s = ServerThread(cfg, step_floor_s=0.03).start(wait_ready=False)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(s.address))

    def status(name="zeroqueue.inference.v1.Inference"):
        return health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status

    assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
    assert status("liveness") == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
        list(s.stub().Generate(pb.GenerateRequest(prompt="x", max_tokens=2), timeout=5))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    (model,) = s.stub().ListModels(pb.ListModelsRequest(), timeout=5).models
    assert model.state == pb.WARMUP_STATE_WARMING_UP
    s.port = s.started.result(timeout=120)
    assert status() == status("") == health_pb2.HealthCheckResponse.SERVING
    long = Background(s.stub(), prompt="def h():", max_tokens=30)
    assert long.admitted.wait(10)
    stopper = threading.Thread(target=s.stop, daemon=True)
    stopper.start()
    deadline = time.monotonic() + 5
    while status() != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as info:
        list(s.stub().Generate(pb.GenerateRequest(prompt="x", max_tokens=2), timeout=5))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    long.join()
    stopper.join(30)
    assert long.error is None and long.messages[-1].WhichOneof("kind") == "final"


def test_a_call_that_arrives_while_a_step_runs_joins_the_very_next_step(server):
    joined = metric(server, "zeroqueue_steps_waited_bucket", le="0.0")
    counted = metric(server, "zeroqueue_steps_waited_count")
    first = fill(server, n=1, max_tokens=30)[0]
    wait_until(lambda: len(first.messages) >= 5)  # steps of 20 ms are running back to back
    late = Background(server.stub(), prompt="y = 2", max_tokens=5, temperature=0.0).join()
    assert late.error is None and late.messages[-1].final.timings.queue_us <= 3 * STEP_S * 1e6
    first.join()
    assert metric(server, "zeroqueue_steps_waited_count") == counted + 2
    assert metric(server, "zeroqueue_steps_waited_bucket", le="0.0") == joined + 2
