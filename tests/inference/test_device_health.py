"""When the device falters, with faults injected into a real replica: a hang fails the device, ends the calls in
flight with a precise code and bills them, takes readiness down and sends new calls elsewhere, then the replica
comes back; a slowdown makes the state slow and admission predict with the measured speed at once."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from zeroqueue.inference.v1 import inference_pb2 as pb

from billing import commands
from services.client import Client
from services.inference.device.executor import ExecutorConfig
from services.inference.health.faults import Fault, FaultKind
from services.inference.health.state import DeviceState
from services.inference.health.watchdog import WatchdogConfig
from services.inference.serve_config import ServeConfig
from tests.inference.harness import ServerThread, status_details
from tests.inference.test_usage import ledger_rows

PROMPT = "def add(a, b):\n    return"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
WATCHDOG = WatchdogConfig(period_s=0.05, min_allowance_s=0.2)  # a hang is judged within 0.2 s + 3 periods
STEP_S = 0.02  # each step's floor: a call of 300 tokens runs for 6 s


def replica(llama_dir, fault: Fault | None, engine_process: bool = True, **config) -> ServerThread:
    config = ServeConfig(
        str(llama_dir),
        port=0,
        engine_process=engine_process,
        executor=ExecutorConfig(max_batch=4, max_seq_len=512),
        watchdog=WATCHDOG,
        fault=fault,
        **config,
    )
    return ServerThread(config, step_floor_s=STEP_S).start()


def health(server: ServerThread, service: str = "") -> int:
    with grpc.insecure_channel(server.address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status


def wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def device_state(server: ServerThread) -> int:
    return server.stub().ListModels(pb.ListModelsRequest(), timeout=5).models[0].device_state


def long_call(server: ServerThread, request_id: str):
    return server.stub().Generate(
        pb.GenerateRequest(prompt=PROMPT, max_tokens=300, temperature=0.0, request_id=request_id), timeout=30
    )


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_a_hung_device_ends_its_calls_billed_goes_not_serving_and_comes_back(llama_dir, engine_process):
    server = replica(llama_dir, Fault(FaultKind.HANG, after_s=1.5, for_s=3.0), engine_process)
    try:
        call = long_call(server, "running")
        assert next(call).HasField("admission")
        streamed = [m for m in call]  # runs until the hang, then ends
    except grpc.RpcError as error:
        ended = error
    else:
        pytest.fail(f"the call finished through a hung device: {streamed[-1]}")
    try:
        assert ended.code() == grpc.StatusCode.UNAVAILABLE, ended.details()
        assert status_details(ended)["ErrorInfo"].reason == "DEVICE_FAILED"
        assert health(server) == NOT_SERVING and health(server, "liveness") == SERVING
        assert device_state(server) == pb.DEVICE_STATE_FAILED
        assert server.replica.metrics.registry.get_sample_value("zeroqueue_device_state", {"state": "failed"}) == 1
        with pytest.raises(grpc.RpcError) as refused:
            list(long_call(server, "during"))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert status_details(refused.value)["ErrorInfo"].reason == "DEVICE_FAILED"
        # the fault clears: the hung step completes, the probes are on time again
        assert wait_for(lambda: health(server) == SERVING)
        assert server.replica.service.device_state is not DeviceState.FAILED
        final = list(server.stub().Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=4, request_id="after")))
        assert final[-1].final.usage.sm_us > 0
    finally:
        server.stop(grace_s=1)
    rows = ledger_rows(
        server.config.ledger_url,
        "SELECT request_id, outcome, completion_tokens, unit_us FROM usage_records ORDER BY request_id",
    )
    assert [(r.request_id, r.outcome) for r in rows] == [("after", "ok"), ("running", "error")]
    running = rows[1]
    assert running.unit_us > 0 and running.completion_tokens >= 1  # billed for the steps that ran, once


def test_a_device_that_stays_failed_takes_liveness_down(llama_dir):
    server = replica(llama_dir, Fault(FaultKind.HANG, after_s=0.5), device_recovery_s=0.5)
    try:
        assert wait_for(lambda: health(server) == NOT_SERVING)
        assert wait_for(lambda: health(server, "liveness") == NOT_SERVING)
    finally:
        server.stop(grace_s=0)


def test_calls_after_a_hang_go_to_the_other_replica(llama_dir, tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    commands.migrate(url)
    key = commands.create_tenant(url, "acme")
    hung = replica(llama_dir, Fault(FaultKind.HANG, after_s=0.5), ledger_url=url)
    healthy = replica(llama_dir, None, ledger_url=url)
    hung.key = healthy.key = key
    try:
        assert wait_for(lambda: device_state(hung) == pb.DEVICE_STATE_FAILED)
        with Client([hung.address, healthy.address], api_key=key) as client:
            results = [client.complete(PROMPT, deadline_ms=10_000, max_tokens=4, temperature=0) for _ in range(4)]
        assert all(r.report.attempts[-1].endpoint == healthy.address for r in results)
        refusals = [(a.outcome, a.reason) for r in results for a in r.report.attempts[:-1]]
        assert set(refusals) <= {("UNAVAILABLE", "DEVICE_FAILED")}  # the hung one refuses at once, precisely
    finally:
        hung.stop(grace_s=0)
        healthy.stop(grace_s=1)


def test_a_slow_device_is_said_slow_and_admission_follows_it_at_once(llama_dir):
    server = replica(llama_dir, Fault(FaultKind.SLOW, 4.0, for_s=5.0))  # 4x slower from the start, for 5 s
    try:
        request = pb.GenerateRequest(prompt=PROMPT, max_tokens=40, temperature=0.0)
        assert list(server.stub().Generate(request, timeout=30))[-1].HasField("final")  # 40 slow steps
        assert device_state(server) == pb.DEVICE_STATE_SLOW
        assert server.replica.cost.ratio >= 2.0  # at once: the running ratio alone moves 5 % a step
        assert health(server) == SERVING  # slow is not out
        time.sleep(5.0)  # the fault is over
        assert list(server.stub().Generate(request, timeout=30))[-1].HasField("final")
        assert device_state(server) == pb.DEVICE_STATE_HEALTHY
        # predictions are back to the calibration with the device, not decaying from 4x over dozens of steps
        assert server.replica.cost.ratio < 1.25
    finally:
        server.stop(grace_s=1)


def test_a_slowdown_mid_call_misses_with_its_credit_on_the_invoice_and_later_calls_keep_theirs(llama_dir):
    server = replica(llama_dir, Fault(FaultKind.SLOW, 8.0, after_s=0.5, for_s=30.0))  # 20-ms steps become 160
    try:
        caught = pb.GenerateRequest(prompt=PROMPT, max_tokens=60, temperature=0.0, request_id="caught")
        with pytest.raises(grpc.RpcError) as missed:  # admitted for 60 steps of 20 ms in 3 s; most run at 160
            list(server.stub().Generate(caught, timeout=3.0))
        assert missed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert status_details(missed.value)["ErrorInfo"].reason == "DEADLINE_MISSED"  # the replica's, in time
        later = []
        for i in range(4):  # admitted on what admission has learnt of the slowed device, or refused
            request = pb.GenerateRequest(prompt=PROMPT, max_tokens=8, temperature=0.0, request_id=f"later-{i}")
            try:
                later.append(list(server.stub().Generate(request, timeout=3.0))[-1].final.timings.deadline_met)
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert later and all(later)
        model = server.replica.header.name
    finally:
        server.stop(grace_s=1)
    url = server.config.ledger_url
    rows = ledger_rows(url, "SELECT request_id, outcome, deadline_met FROM usage_records")
    assert ("caught", "deadline_exceeded", False) in [tuple(r) for r in rows]
    commands.add_price(url, model, "core_us", 1_000_000, "USD", "2020-01-01T00:00:00Z")
    period = time.strftime("%Y-%m", time.gmtime())
    lines = json.loads(commands.invoice(url, "acme", period))["lines"]
    assert [line["kind"] for line in lines] == ["usage", "sla_credit"]  # the missed call is not charged
    assert lines[1]["amount_micros"] < 0
