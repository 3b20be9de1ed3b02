"""A caller's request_id is an idempotency key scoped to its tenant, never a handle: each admitted call is
known inside the replica by the id the replica made for it, and billed once, as its own record."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from zeroqueue.inference.v1 import inference_pb2 as pb

from billing import commands
from services.inference.device.executor import ExecutorConfig
from services.inference.serve_config import ServeConfig
from tests.billing.conftest import ledger, postgres_schema_url, sqlite_template  # noqa: F401 - fixtures
from tests.inference.harness import ServerThread, status_details
from tests.inference.test_usage import ledger_rows

PROMPT = "def add(a, b):\n    return"


@pytest.fixture
def replica(ledger, llama_dir):  # noqa: F811 - the ledger fixture, on SQLite and PostgreSQL
    keys = {tenant: commands.create_tenant(ledger.url, tenant) for tenant in ("acme", "beta")}
    server = ServerThread(
        ServeConfig(
            str(llama_dir), port=0, ledger_url=ledger.url, executor=ExecutorConfig(max_batch=4, max_seq_len=256)
        )
    ).start()
    yield server, keys
    server.stop()


def call(server, key, **fields) -> tuple[pb.Admission, pb.Final]:
    fields.setdefault("prompt", PROMPT)
    fields.setdefault("max_tokens", 6)
    messages = list(server.stub(key=key).Generate(pb.GenerateRequest(temperature=0.0, **fields), timeout=30))
    return messages[0].admission, messages[-1].final


def test_a_reused_request_id_is_billed_once_per_admitted_call_in_every_tenant(replica):
    server, keys = replica
    served = [("acme", *call(server, keys["acme"], request_id="same")) for _ in range(3)]
    served += [("beta", *call(server, keys["beta"], request_id="same")) for _ in range(2)]
    # one acme call with the id in flight: acme's second is refused, beta's is admitted beside it
    running = server.stub(key=keys["acme"]).Generate(
        pb.GenerateRequest(prompt=PROMPT, max_tokens=40, temperature=0.0, request_id="dup"), timeout=30
    )
    first = next(running).admission
    with pytest.raises(grpc.RpcError) as refused:
        call(server, keys["acme"], request_id="dup")
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert status_details(refused.value)["ErrorInfo"].reason == "REQUEST_ID_IN_USE"
    served.append(("beta", *call(server, keys["beta"], request_id="dup")))
    served.append(("acme", first, list(running)[-1].final))
    server.stop()
    rows = ledger_rows(
        server.config.ledger_url,
        "SELECT u.call_id, u.request_id, t.name AS tenant, "
        "u.unit_us FROM usage_records u JOIN tenants t ON t.id = u.tenant_id",
    )
    billed = sorted((r.call_id, r.request_id, r.tenant, r.unit_us) for r in rows)
    assert billed == sorted((a.call_id, a.request_id, tenant, f.usage.sm_us) for tenant, a, f in served)
    assert len({a.call_id for _, a, _ in served}) == len(served) == 7


def test_cancel_then_reuse_at_once_never_harms_another_tenants_calls(replica):
    server, keys = replica
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))
    stop, bystander, unhealthy = threading.Event(), [], []

    def other_tenant() -> None:
        while not stop.is_set():
            try:
                bystander.append(call(server, keys["beta"], max_tokens=12)[1].finish_reason)
            except grpc.RpcError as error:  # collateral damage: what this test looks for
                bystander.append(error.code().name)
            status = health.Check(
                health_pb2.HealthCheckRequest(service="zeroqueue.inference.v1.Inference"), timeout=5
            ).status
            if status != health_pb2.HealthCheckResponse.SERVING:
                unhealthy.append(status)

    thread = threading.Thread(target=other_tenant, daemon=True)
    thread.start()
    stub, codes = server.stub(key=keys["acme"]), []
    try:
        for _ in range(200):
            reused = stub.Generate(
                pb.GenerateRequest(prompt=PROMPT, max_tokens=50, temperature=0.0, request_id="race"), timeout=30
            )
            try:
                next(reused)  # admitted (or refused: the last one is still closing)
                reused.cancel()
                codes.append("cancelled")
            except grpc.RpcError as error:
                codes.append(error.code().name)
        admission, final = call(server, keys["acme"], request_id="race")
    finally:
        stop.set()
        thread.join(30)
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and admission.request_id == "race"
    assert set(codes) <= {"cancelled", "ALREADY_EXISTS"} and codes.count("cancelled") >= 100
    assert bystander and set(bystander) == {pb.FINISH_REASON_LENGTH} and not unhealthy
