"""Classes of service on a real replica whose policy comes from its ledger: the request's service_class checked at
the boundary (size, characters, known, budget range), the class a call without one gets from its budget, and the
class carried to the Admission message, the usage record, the refusal metrics and ListModels' offers."""

from __future__ import annotations

import contextlib

import grpc
import pytest
import structlog
from structlog.testing import capture_logs
from zeroqueue.inference.v1 import inference_pb2 as pb

from billing import pricing, service_classes
from billing.commands import sessions
from billing.db import unit_of_work
from billing.policy import STANDARD, ClassSpec, ServingPolicy
from services import errors
from services.inference.call import BudgetSource
from services.inference.device.checkpoint import read_header
from services.inference.device.executor import ExecutorConfig
from services.inference.policy import class_of
from services.inference.serve_config import ServeConfig
from tests.inference.harness import ServerThread, status_details
from tests.inference.test_overload import wait_until
from tests.inference.test_usage import ledger_rows

INTERACTIVE = ClassSpec("interactive", 1, 5_000, 10, 1_000_000)
BATCH = ClassSpec("batch", 10_000, 86_400_000, 0, 0)
GENERIC_PRICE_MICROS, INTERACTIVE_PRICE_MICROS = 20, 35


@contextlib.contextmanager
def ledger(url: str):
    with sessions(url) as factory, unit_of_work(factory) as session:
        yield session


def add_classes(url: str, *specs: ClassSpec) -> None:
    with ledger(url) as session:
        for s in specs:
            service_classes.add_class(
                session,
                s.name,
                min_budget_ms=s.min_budget_ms,
                max_budget_ms=s.max_budget_ms,
                priority=s.priority,
                credit_ppm=s.credit_ppm,
            )


@pytest.fixture(scope="module")
def server(llama_dir):
    config = ServeConfig(
        str(llama_dir), port=0, executor=ExecutorConfig(max_batch=4, max_seq_len=256), policy_refresh_s=0.2
    )
    s = ServerThread(config)
    url = s.config.ledger_url
    add_classes(url, INTERACTIVE, BATCH)
    model = read_header(str(llama_dir), "auto").name
    with ledger(url) as session:
        pricing.add_price(session, model, "core_us", GENERIC_PRICE_MICROS, "EUR", 0)
        pricing.add_price(session, model, "core_us", INTERACTIVE_PRICE_MICROS, "EUR", 0, service_class="interactive")
    s.start()
    wait_until(lambda: s.replica.book.policy.class_named("interactive") is not None, timeout=10)
    yield s
    s.stop()


def generate(stub, timeout=10.0, **fields):
    fields.setdefault("prompt", "def f(x):")
    fields.setdefault("max_tokens", 2)
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=timeout))


def refused(stub, timeout=10.0, **fields) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, timeout, **fields)
    return info.value


def the_violation(error: grpc.RpcError) -> tuple[str, str]:
    (violation,) = status_details(error)["BadRequest"].field_violations
    return violation.field, violation.description


# --- the field at the boundary -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, said",
    [
        ("x" * 33, "at most 32 characters, got 33"),
        ("x" * 20_000, "at most 32 characters, got 20000"),
        ("Gold", "a-z 0-9 _ -"),
        ("gold class", "a-z 0-9 _ -"),
        ("gold\x00", "a-z 0-9 _ -"),
        ("él", "a-z 0-9 _ -"),
    ],
    ids=["33-chars", "20000-chars", "upper-case", "space", "nul", "non-ascii"],
)
def test_a_malformed_class_name_is_refused_naming_service_class(server, name, said):
    error = refused(server.stub(), service_class=name)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    field, description = the_violation(error)
    assert field == "service_class" and said in description
    assert len(error.details()) < 512  # a long name is never echoed whole
    assert not server.replica.service.in_flight


def test_an_unknown_class_is_refused_naming_service_class_and_the_classes_offered(server):
    error = refused(server.stub(), service_class="gold")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    field, description = the_violation(error)
    assert field == "service_class" and "unknown class 'gold'" in description
    assert all(name in description for name in ("interactive", "batch", "standard"))
    info = status_details(error)["ErrorInfo"]
    assert info.reason == "UNKNOWN_SERVICE_CLASS" and info.metadata["service_class"] == "gold"


@pytest.mark.parametrize("name, timeout_s", [("interactive", 30.0), ("batch", 2.0)], ids=["above", "below"])
def test_a_class_that_does_not_accept_the_budget_is_refused_with_its_range(server, name, timeout_s):
    spec = server.replica.book.policy.class_named(name)
    error = refused(server.stub(), timeout=timeout_s, service_class=name)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    field, description = the_violation(error)
    assert field == "service_class"
    assert f"accepts budgets of {spec.min_budget_ms} to {spec.max_budget_ms} ms" in description
    info = status_details(error)["ErrorInfo"]
    assert info.reason == "BUDGET_OUTSIDE_CLASS" and info.metadata["max_budget_ms"] == str(spec.max_budget_ms)


def test_a_budget_no_class_accepts_is_refused_naming_the_deadline(server):
    error = refused(server.stub(), timeout=2 * 86_400.0)  # over every class's range: standard's too
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    field, description = the_violation(error)
    assert field == "deadline" and "no class of service accepts" in description
    assert status_details(error)["ErrorInfo"].reason == "NO_CLASS_FOR_BUDGET"


@pytest.mark.parametrize("timeout_s, expected", [(2.0, "standard"), (20.0, "batch")])
def test_a_call_naming_no_class_gets_the_least_privileged_one_its_budget_fits(server, timeout_s, expected):
    messages = generate(server.stub(), timeout=timeout_s)
    assert messages[0].admission.service_class == expected


def test_a_named_class_runs_and_is_billed_in_it(server):
    messages = generate(server.stub(), timeout=3.0, service_class="interactive", request_id="cls-1")
    admission = messages[0].admission
    assert admission.service_class == "interactive" and messages[-1].final.usage.sm_us > 0
    url = server.config.ledger_url
    sql = f"SELECT service_class FROM usage_records WHERE call_id = '{admission.call_id}'"
    wait_until(lambda: ledger_rows(url, sql), timeout=15)  # shipped from the outbox
    assert ledger_rows(url, sql) == [("interactive",)]
    done = server.replica.metrics.registry.get_sample_value(
        "zeroqueue_class_requests_total", {"service_class": "interactive", "outcome": "ok"}
    )
    assert done >= 1


def test_a_refusal_is_counted_with_its_class(server):
    error = refused(server.stub(), timeout=0.02, max_tokens=200, service_class="interactive")
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # infeasible: refused by admission, in its class
    value = server.replica.metrics.registry.get_sample_value(
        "zeroqueue_refusals_total", {"cause": "infeasible", "tenant": "acme", "service_class": "interactive"}
    )
    assert value >= 1


def test_the_class_priority_reaches_admission(server):
    seen = []
    admission = server.replica.service.admission
    decide = admission.decide

    def spy(commitment, now_ns):
        seen.append(commitment)
        return decide(commitment, now_ns)

    admission.decide = spy
    try:
        for name in ("interactive", ""):
            with contextlib.suppress(grpc.RpcError):  # admitted or not: what admission was asked is the point
                generate(server.stub(), timeout=3.0, service_class=name)
    finally:
        del admission.decide
    assert [c.priority for c in seen] == [INTERACTIVE.priority, STANDARD.priority]


# --- ListModels ---------------------------------------------------------------------------------------------------


def test_list_models_offers_every_class_with_its_price_here(server):
    (model,) = server.stub().ListModels(pb.ListModelsRequest(), timeout=5).models
    offers = {offer.name: offer for offer in model.classes}
    assert set(offers) == {"standard", "interactive", "batch"}
    interactive, batch = offers["interactive"], offers["batch"]
    assert (interactive.price_micros, interactive.currency) == (INTERACTIVE_PRICE_MICROS, "EUR")
    assert (batch.price_micros, offers["standard"].price_micros) == (GENERIC_PRICE_MICROS, GENERIC_PRICE_MICROS)
    assert (interactive.min_budget_ms, interactive.max_budget_ms) == (1, 5_000)
    assert (interactive.priority, interactive.credit_ppm) == (10, 1_000_000)
    assert (batch.min_budget_ms, batch.priority, batch.credit_ppm) == (10_000, 0, 0)


# --- the rule on its own -------------------------------------------------------------------------------------------


POLICY = ServingPolicy(classes=(STANDARD, INTERACTIVE, BATCH))


def test_class_of_takes_a_named_class_only_inside_its_range():
    assert class_of(POLICY, "interactive", 5_000, BudgetSource.CLIENT_DEADLINE) is INTERACTIVE
    with pytest.raises(errors.ServiceClassRefused) as info:
        class_of(POLICY, "interactive", 5_001, BudgetSource.SERVER_DEFAULT)
    assert info.value.violations[0].field == "service_class" and "server's default" in info.value.message


def test_class_of_without_a_name_prefers_the_lowest_priority_then_the_narrowest_range():
    assert class_of(POLICY, "", 3_000, BudgetSource.CLIENT_DEADLINE) is STANDARD
    assert class_of(POLICY, "", 10_000, BudgetSource.CLIENT_DEADLINE) is BATCH
    only_interactive = ServingPolicy(classes=(INTERACTIVE,))
    with pytest.raises(errors.ServiceClassRefused) as info:
        class_of(only_interactive, "", 6_000, BudgetSource.CLIENT_DEADLINE)
    assert info.value.violations[0].field == "deadline" and "interactive (1-5000 ms)" in info.value.message


def test_each_call_s_log_lines_carry_its_own_tenant_and_class(server):
    calls = [  # request_id, class, deadline (s): admitted or refused, each call has its line
        ("log-std", "", 3.0),
        ("log-int", "interactive", 0.02),  # infeasible: refused with an info line, in its class
        ("log-gold", "gold", 3.0),  # refused before it has a class: no class, not another call's
    ]
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        for request_id, name, timeout_s in calls:
            with contextlib.suppress(grpc.RpcError):
                generate(server.stub(), timeout_s, max_tokens=200, service_class=name, request_id=request_id)
        wait_until(lambda: {e.get("request_id") for e in logs} >= {rid for rid, _, _ in calls})
    lines = {e["request_id"]: e for e in logs if e["event"] in ("rpc_error", "request_done")}
    assert (lines["log-std"]["service_class"], lines["log-std"]["tenant"]) == ("standard", "acme")
    assert (lines["log-int"]["service_class"], lines["log-int"]["tenant"]) == ("interactive", "acme")
    assert lines["log-int"]["reason"] == "DEADLINE_INFEASIBLE"
    assert lines["log-gold"]["reason"] == "UNKNOWN_SERVICE_CLASS" and "service_class" not in lines["log-gold"]


def test_the_sdk_names_a_class_and_reads_the_offers(server):
    from services.client import Client

    with Client([server.address], api_key=server.key) as client:
        result = client.complete("def f(x):", deadline_ms=3_000, max_tokens=2, service_class="interactive")
        (model,) = client.list_models()
    assert result.admission.service_class == "interactive"
    offers = {offer.name: offer for offer in model.classes}
    assert offers["interactive"].price_micros == INTERACTIVE_PRICE_MICROS and offers["batch"].min_budget_ms == 10_000
