"""The gRPC service on a real loopback channel, with the tiny test model."""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from zeroqueue.inference.v1 import inference_pb2 as pb

from services import errors
from services.inference.call import BudgetSource, GenerateSpec
from services.inference.device.executor import ExecutorConfig
from services.inference.sched.request import SamplingParams
from services.inference.serve_config import ServeConfig
from services.status import status_for
from tests.inference.conftest import Collector, make_engine, request, run_to_completion
from tests.inference.harness import ServerThread, status_details

PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(ServeConfig(str(llama_dir), port=0, executor=ExecutorConfig(max_batch=4, max_seq_len=256)))
    yield s.start()
    s.stop()


def generate(stub, timeout=30, metadata=(), **fields):
    fields.setdefault("prompt", PROMPT)
    fields.setdefault("max_tokens", 8)
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=timeout, metadata=metadata))


def rejected(stub, timeout=30, **fields) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, timeout=timeout, **fields)
    return info.value


def health(server, name="zeroqueue.inference.v1.Inference"):
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))  # probes need no key
    return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status


def test_stream_has_admission_tokens_and_final_like_the_engine(server, llama_dir):
    messages = generate(server.stub(), max_tokens=12, temperature=0.0)
    kinds = [m.WhichOneof("kind") for m in messages]
    assert kinds[0] == "admission" and kinds[-1] == "final" and set(kinds[1:-1]) == {"chunk"}
    tokens = [t for m in messages[1:-1] for t in m.chunk.token_ids]
    engine = make_engine(llama_dir)
    sink = Collector()
    engine.add_request(request("ref", engine.tokenizer.encode(PROMPT).ids, max_tokens=12), sink)
    run_to_completion(engine)
    assert tokens == sink.tokens("ref")
    a, final = messages[0].admission, messages[-1].final
    assert a.received_at_us <= a.dispatched_at_us <= a.predicted_finish_at_us <= a.deadline_at_us
    # gRPC's grpc-timeout header rounds the client's 30 s up to 30.1 s (fresh-clone CI once read 30,093 ms): the
    # budget takes that unit off, so the server never plans on more time than the caller gave
    assert 29_000 <= a.budget_ms <= 30_000 and a.budget_source == pb.BUDGET_SOURCE_CLIENT_DEADLINE
    t = final.timings
    assert t.received_at_us == a.received_at_us
    assert t.received_at_us <= t.first_scheduled_at_us <= t.first_token_at_us <= t.finished_at_us
    assert t.ttft_us == t.first_token_at_us - t.received_at_us and t.deadline_met
    assert final.usage.completion_tokens == 12 and final.usage.prompt_tokens == a.prompt_tokens
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    emitted = [m.chunk.emitted_at_us for m in messages[1:-1]]
    assert emitted == sorted(emitted) and emitted[0] == t.first_token_at_us


def test_call_without_deadline_gets_the_default_budget_and_says_so(server):
    call = server.stub().Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=2))
    messages = list(call)
    assert messages[0].admission.budget_source == pb.BUDGET_SOURCE_SERVER_DEFAULT
    assert messages[0].admission.budget_ms == 30_000
    assert dict(call.initial_metadata())["x-budget-source"] == "server_default"


def test_prompt_token_ids_and_seeded_sampling_are_reproducible(server):
    ids = [5, 6, 7, 8, 9]
    runs = [
        generate(server.stub(), prompt="", prompt_token_ids=ids, max_tokens=10, temperature=0.9, seed=42)
        for _ in range(2)
    ]
    streams = [[t for m in r[1:-1] for t in m.chunk.token_ids] for r in runs]
    assert streams[0] == streams[1] and len(streams[0]) == 10


def test_list_models(server):
    (model,) = server.stub().ListModels(pb.ListModelsRequest(), timeout=5).models
    assert model.state == pb.WARMUP_STATE_READY and model.context_length == 256 and model.max_batch == 4
    assert model.device_kind == "cpu" and model.unit == "core_us" and model.num_compute_units >= 1
    # a ledger with no classes or prices of its own: the standard class, every budget, no price set
    (offer,) = model.classes
    assert (offer.name, offer.min_budget_ms, offer.max_budget_ms) == ("standard", 1, 86_400_000)
    assert (offer.price_micros, offer.priority, offer.credit_ppm) == (-1, 0, 1_000_000)


def test_a_call_naming_no_class_runs_in_the_standard_class(server):
    assert generate(server.stub())[0].admission.service_class == "standard"
    assert generate(server.stub(), service_class="standard")[0].admission.service_class == "standard"


BAD_INPUTS = [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(prompt="x " * 400), grpc.StatusCode.OUT_OF_RANGE, "prompt"),
    (dict(prompt="x" * ((1 << 20) + 1)), grpc.StatusCode.OUT_OF_RANGE, "prompt"),
    (dict(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(max_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(max_tokens=250), grpc.StatusCode.OUT_OF_RANGE, "max_tokens"),
    (dict(model="gpt-9"), grpc.StatusCode.INVALID_ARGUMENT, "model"),
    (dict(temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(temperature=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(top_k=-1), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    (dict(stop=["a"] * 9), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    (dict(stop=["ok", "y" * 65]), grpc.StatusCode.INVALID_ARGUMENT, "stop[1]"),
    (dict(stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop[0]"),
    (dict(prompt="", prompt_token_ids=[1, 2, 100000]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[2]"),
    (dict(prompt="", prompt_token_ids=[-1]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[0]"),
    (dict(prompt="hi", prompt_token_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    (dict(request_id="has spaces!"), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    (dict(labels={"team": "t" * 300}), grpc.StatusCode.INVALID_ARGUMENT, "labels.team"),
    (dict(labels={"Bad Key": "x"}), grpc.StatusCode.INVALID_ARGUMENT, "labels.Bad Key"),
    (dict(service_class="gold"), grpc.StatusCode.INVALID_ARGUMENT, "service_class"),
    (dict(service_class="s" * 33), grpc.StatusCode.INVALID_ARGUMENT, "service_class"),
    (dict(service_class="Standard"), grpc.StatusCode.INVALID_ARGUMENT, "service_class"),
]


@pytest.mark.parametrize("fields,code,field", BAD_INPUTS, ids=[c[2] + "-" + str(i) for i, c in enumerate(BAD_INPUTS)])
def test_bad_input_gets_a_precise_status_naming_the_field(server, fields, code, field):
    error = rejected(server.stub(grpc_max_send_message_length=8 << 20), **fields)
    assert error.code() == code, error.details()
    details = status_details(error)
    assert [v.field for v in details["BadRequest"].field_violations] == [field]
    assert field.split("[")[0] in error.details()
    assert health(server) == health_pb2.HealthCheckResponse.SERVING
    assert not server.replica.service.in_flight


def test_several_bad_fields_are_reported_together(server):
    error = rejected(server.stub(), prompt="", max_tokens=0, top_k=-2)
    fields = {v.field for v in status_details(error)["BadRequest"].field_violations}
    assert fields == {"prompt", "max_tokens", "top_k"}


def test_budget_infeasible_on_an_idle_server_is_refused_at_once_with_the_minimum(server):
    error = rejected(server.stub(), timeout=0.02, max_tokens=200, prompt="x")
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    info = status_details(error)["ErrorInfo"]
    assert info.reason == "DEADLINE_INFEASIBLE"
    min_budget_ms = int(info.metadata["min_budget_ms"])
    assert min_budget_ms > 20
    assert "RetryInfo" not in status_details(error)
    trailing = dict(error.trailing_metadata())
    assert "retry-after-ms" not in trailing and int(trailing["grpc-retry-pushback-ms"]) < 0
    # a budget over the minimum is never called infeasible; it is admitted once the load this suite leaves on the
    # host allows (the minimum is the idle device's, the admission the running one's), and then meets its deadline
    for factor in (2, 4, 8, 16):
        try:
            messages = generate(server.stub(), timeout=min_budget_ms * factor / 1000, max_tokens=200, prompt="x")
        except grpc.RpcError as refused:
            assert status_details(refused)["ErrorInfo"].reason == "OVERLOADED"
            continue
        assert messages[-1].final.timings.deadline_met
        break
    else:
        pytest.fail("not admitted even with 16 times the minimum budget")


def test_deadline_already_expired_on_arrival(server):
    # a client cannot send an expired deadline over the wire (its own timer fires first), so ask the service
    service = server.replica.service
    spec = GenerateSpec("expired", (1, 2), SamplingParams(), {})
    future = asyncio.run_coroutine_threadsafe(_submit(service, spec, budget_ns=-1), server.loop)
    with pytest.raises(errors.DeadlineExpired):
        future.result(10)
    status = status_for(errors.DeadlineExpired("x"))
    assert status.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert status.details[0].reason == "DEADLINE_EXPIRED"
    assert "expired" not in service.in_flight


async def _submit(service, spec, budget_ns):
    return service.submit(spec, "acme", time.monotonic_ns(), budget_ns, BudgetSource.CLIENT_DEADLINE)


def test_every_call_needs_a_valid_tenant_key(server):
    for key in ("", "zq_not-a-key"):
        error = rejected(server.stub(key=key))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert status_details(error)["ErrorInfo"].reason
    with pytest.raises(grpc.RpcError) as info:
        server.stub(key="").ListModels(pb.ListModelsRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_reflection_lists_the_services(server):
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(server.address))
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"zeroqueue.inference.v1.Inference", "grpc.health.v1.Health"} <= names


def test_client_cancel_frees_the_slot(server):
    # the engine runs in its own process: the free-slot gauge is what each step reports from there
    def free():
        return server.replica.metrics.registry.get_sample_value("zeroqueue_kv_slots_free")

    slots = server.replica.service.card.max_batch
    call = server.stub().Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=200, temperature=0.0), timeout=30)
    next(call)
    next(call)
    assert free() == slots - 1
    call.cancel()
    deadline = time.monotonic() + 5
    while free() != slots and time.monotonic() < deadline:
        time.sleep(0.005)
    assert free() == slots
    used = server.replica.metrics.registry.get_sample_value("zeroqueue_kv_blocks", {"state": "used"})
    assert used == 0, "the cancelled call's KV blocks are still held"
    assert not server.replica.service.in_flight or _wait_empty(server)


def test_list_models_reports_the_kv_pool(server):
    (model,) = server.stub().ListModels(pb.ListModelsRequest(), timeout=5).models
    # 4 slots of 256 tokens in blocks of 16: the pool holds every slot at its longest twice over (admission reserves
    # a call's blocks while the call it follows into a freeing slot still holds its own)
    assert (model.kv_blocks, model.kv_block_size, model.prefix_cache) == (2 * 4 * 256 // 16, 16, True)


def _wait_empty(server, timeout=5.0):
    deadline = time.monotonic() + timeout
    while server.replica.service.in_flight and time.monotonic() < deadline:
        time.sleep(0.005)
    return not server.replica.service.in_flight


def test_request_id_in_flight_cannot_be_reused(server):
    # greedy: a sampled end-of-sequence (1 in 320 tokens on this random model) could end the call too early
    call = server.stub().Generate(
        pb.GenerateRequest(prompt=PROMPT, max_tokens=200, request_id="dup-1", temperature=0.0), timeout=30
    )
    next(call)
    error = rejected(server.stub(), request_id="dup-1")
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()
    assert _wait_empty(server)
