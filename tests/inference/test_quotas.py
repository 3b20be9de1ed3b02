"""Tenants' quotas at admission: a tenant at its monthly cap (as its ledger counts it) is refused RESOURCE_EXHAUSTED
with a QuotaFailure while another tenant is served; calls per second are a token bucket per tenant; a failed read
of the policy keeps the last one and fails no call. The rules on their own first, then on a real replica."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from zeroqueue.inference.v1 import inference_pb2 as pb

from billing import commands, service_classes
from billing.policy import DEVICE_CAP, RATE_CAP, SPEND_CAP, ServingPolicy, TenantQuota
from services import errors
from services.client import Client, QuotaExceeded
from services.inference.device.executor import ExecutorConfig
from services.inference.policy import PolicyBook, QuotaGate, weights_of
from services.inference.serve_config import ServeConfig
from tests.inference.harness import ServerThread, status_details
from tests.inference.test_overload import wait_until
from tests.inference.test_service_class import ledger
from tests.inference.test_usage import ledger_rows

S = 1_000_000_000  # ns
RESET_US = 1_800_000_000_000_000


def gate(*quotas: TenantQuota, now_us: int = RESET_US - 3_600_000_000) -> QuotaGate:
    policy = ServingPolicy(tenants={q.tenant: q for q in quotas})
    return QuotaGate(SimpleNamespace(policy=policy), lambda: now_us)


# --- the rules ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "quota, cap, said",
    [
        (
            TenantQuota("acme", device_us_per_month=3_600, used_device_us=3_600, resets_at_us=RESET_US),
            DEVICE_CAP,
            "3600 of 3600",
        ),
        (
            TenantQuota("acme", spend_micros_per_month=500, spent_micros=731, resets_at_us=RESET_US),
            SPEND_CAP,
            "731 of 500",
        ),
    ],
    ids=["device-time", "spend"],
)
def test_a_tenant_at_a_monthly_cap_is_refused_until_the_month_resets(quota, cap, said):
    with pytest.raises(errors.QuotaExceeded) as info:
        gate(quota).check("acme", 0, 10 * S)
    refusal = info.value
    assert refusal.subject == "tenant:acme" and refusal.description == f"{cap}: {said} used"
    assert refusal.retry_after_ms == 3_600_000 and refusal.pushback_ms == -1  # an hour: past a 10 s budget
    assert refusal.metadata["cap"] == cap and refusal.metadata["resets_at_us"] == str(RESET_US)
    gate(quota).check("other", 0, 10 * S)  # another tenant: no quota of its own, served
    gate(quota, now_us=RESET_US).check("acme", 0, 10 * S)  # the month is over: the next read says this one's use


def test_under_its_caps_a_tenant_is_served():
    quota = TenantQuota("acme", device_us_per_month=3_600, used_device_us=3_599, spend_micros_per_month=10)
    gate(quota).check("acme", 0, S)


def test_the_call_rate_is_a_bucket_of_calls_per_s_refilled_as_many_a_second():
    g = gate(TenantQuota("acme", calls_per_s=4))
    for _ in range(4):  # a full bucket: a burst of calls_per_s
        g.check("acme", 0, S)
    with pytest.raises(errors.QuotaExceeded) as info:
        g.check("acme", 0, S)
    refusal = info.value
    assert refusal.metadata["cap"] == RATE_CAP and refusal.retry_after_ms == 250  # a token each 1/4 s
    assert refusal.pushback_ms == 250  # inside the budget: retry then
    with pytest.raises(errors.QuotaExceeded) as info:
        g.check("acme", S // 8, S // 10)
    assert info.value.retry_after_ms == 125 and info.value.pushback_ms == -1  # not inside a 100 ms budget
    g.check("acme", S // 4, S)  # the token came
    g.check("acme", 2 * S, S)  # refilled, never above its capacity:
    for _ in range(3):
        g.check("acme", 2 * S, S)
    with pytest.raises(errors.QuotaExceeded):
        g.check("acme", 2 * S, S)
    g.check("other", 2 * S, S)  # another tenant has its own bucket, or none


def test_the_quota_reply_carries_quota_failure_error_info_retry_info_and_the_pushback():
    from services.status import status_for

    status = status_for(errors.QuotaExceeded("acme", RATE_CAP, 4, 4, 250, 1_000))
    by_type = {type(d).__name__: d for d in status.details}
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert by_type["ErrorInfo"].reason == "QUOTA_EXCEEDED" and by_type["ErrorInfo"].metadata["cap"] == RATE_CAP
    (violation,) = by_type["QuotaFailure"].violations
    assert (violation.subject, violation.description) == ("tenant:acme", "calls_per_s: 4 of 4 used")
    assert by_type["RetryInfo"].retry_delay.ToMilliseconds() == 250
    trailers = dict(status.trailing_metadata)
    assert trailers["retry-after-ms"] == trailers["grpc-retry-pushback-ms"] == "250"


def test_a_failed_refresh_keeps_the_last_policy_and_tells_no_listener():
    capped = ServingPolicy(tenants={"acme": TenantQuota("acme", weight=3, calls_per_s=1)})
    answers = [capped, RuntimeError("ledger down")]
    told, refreshes = [], []

    async def read():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def main():
        book = PolicyBook(read, on_refresh=lambda ok, policy: refreshes.append(ok))
        book.subscribe(told.append)
        assert await book.refresh() and book.policy is capped
        assert not await book.refresh() and book.policy is capped and book.failures == 1
        return book

    asyncio.run(main())
    assert told == [ServingPolicy(), capped] and refreshes == [True, False]
    assert weights_of(capped) == {"acme": 3.0}


@pytest.mark.parametrize("fails", [False, True])
def test_the_first_read_is_awaited_before_serving_and_says_whether_it_read(fails: bool):
    """A replica says SERVING after its first policy read has ended, so its first calls meet the ledger's classes
    and caps; a failed first read does not keep it from serving (the book reads again)."""
    capped = ServingPolicy(tenants={"acme": TenantQuota("acme", calls_per_s=1)})
    gate = asyncio.Event()

    async def read():
        await gate.wait()
        if fails:
            raise RuntimeError("ledger down")
        return capped

    async def main():
        book = PolicyBook(read, refresh_s=60)
        book.start()
        waiting = asyncio.ensure_future(book.first_read())
        await asyncio.sleep(0)
        assert not waiting.done()  # the read has not ended: nothing to serve with yet
        gate.set()
        read_ok = await waiting
        policy = book.policy
        await book.stop()
        return read_ok, policy

    read_ok, policy = asyncio.run(main())
    assert read_ok is not fails and (policy is capped) is not fails


def test_a_hung_read_is_a_failed_refresh_and_the_next_one_waits_on_it_instead_of_starting_another(monkeypatch):
    from services.inference.policy import book

    monkeypatch.setattr(book, "READ_TIMEOUT_S", 0.01)
    reads, fresh = [], ServingPolicy(tenants={"acme": TenantQuota("acme", weight=2)})

    async def main():
        release = asyncio.Event()

        async def read():
            reads.append(1)
            await release.wait()
            return fresh

        book = PolicyBook(read)
        assert not await book.refresh() and not await book.refresh()  # each waits a while, then gives up
        release.set()
        assert await book.refresh() and book.policy is fresh  # the same read, come back
        await book.stop()

    asyncio.run(main())
    assert len(reads) == 1


# --- on a replica, through its ledger ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama_dir):
    config = ServeConfig(
        str(llama_dir), port=0, executor=ExecutorConfig(max_batch=4, max_seq_len=256), policy_refresh_s=0.2
    )
    s = ServerThread(config)
    s.other_key = commands.create_tenant(s.config.ledger_url, "other")
    s.start()
    yield s
    s.stop()


def set_policy(server, tenant: str, **caps) -> None:
    with ledger(server.config.ledger_url) as session:
        service_classes.set_tenant_policy(session, tenant, **caps)
    # a read that began before the commit may end after it, without the change: wait for one that began after
    committed_us = time.time_ns() // 1000
    wait_until(lambda: server.replica.book.policy.read_at_us > committed_us, timeout=10)


def generate(stub, timeout=10.0, **fields):
    fields.setdefault("prompt", "def f(x):")
    fields.setdefault("max_tokens", 2)
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=timeout))


def quota_failure(error: grpc.RpcError) -> error_details_pb2.QuotaFailure:
    status: status_pb2.Status = rpc_status.from_call(error)
    found = [d for d in status.details if d.Is(error_details_pb2.QuotaFailure.DESCRIPTOR)]
    failure = error_details_pb2.QuotaFailure()
    found[0].Unpack(failure)
    return failure


def refused_for_quota(server, stub) -> grpc.RpcError | None:
    try:
        generate(stub)
    except grpc.RpcError as error:
        return error
    return None


def test_a_tenant_at_its_monthly_device_cap_is_refused_while_another_is_served(server):
    acme, other = server.stub(), server.stub(key=server.other_key)
    generate(acme)  # some device time on acme's account
    set_policy(server, "acme", device_us_per_month=1)
    # once the ledger has acme's usage (the outbox ships it) and the replica has read it again, acme is refused
    wait_until(lambda: refused_for_quota(server, acme) is not None, timeout=20)
    billed_before = ledger_rows(server.config.ledger_url, "SELECT COUNT(*) FROM usage_records")[0][0]
    with pytest.raises(grpc.RpcError) as info:
        generate(acme, request_id="over-cap-1")
    error = info.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    (violation,) = quota_failure(error).violations
    assert violation.subject == "tenant:acme"
    assert violation.description.startswith("device_us_per_month: ") and violation.description.endswith(" of 1 used")
    details = status_details(error)
    info_ = details["ErrorInfo"]
    assert info_.reason == "QUOTA_EXCEEDED" and info_.metadata["cap"] == "device_us_per_month"
    resets_at_us = int(info_.metadata["resets_at_us"])
    assert resets_at_us == server.replica.book.policy.quota_of("acme").resets_at_us
    trailers = dict(error.trailing_metadata())
    delay_ms = details["RetryInfo"].retry_delay.ToMilliseconds()
    assert delay_ms == int(trailers["retry-after-ms"]) > 0
    assert trailers["grpc-retry-pushback-ms"] == ("-1" if delay_ms >= 10_000 else str(delay_ms))
    assert generate(other)[-1].final.usage.sm_us > 0  # the other tenant is unaffected
    quota_refusals = server.replica.metrics.registry.get_sample_value(
        "zeroqueue_refusals_total", {"cause": "quota", "tenant": "acme", "service_class": "standard"}
    )
    assert quota_refusals >= 1
    # the SDK says QuotaExceeded, with the cap and when it resets, after one attempt
    with Client([server.address], api_key=server.key) as client, pytest.raises(QuotaExceeded) as raised:
        client.complete("def f(x):", deadline_ms=5_000, max_tokens=2)
    assert raised.value.cap == "device_us_per_month" and raised.value.resets_at_us == resets_at_us
    assert raised.value.report.num_attempts == 1 and raised.value.report.gave_up == "quota"
    set_policy(server, "acme", device_us_per_month=None)
    assert generate(acme)[-1].final.usage.sm_us > 0  # the cap lifted: served again
    # the two calls served since are billed once the outbox has shipped them; the refused one never is
    count = "SELECT COUNT(*) FROM usage_records"
    wait_until(lambda: ledger_rows(server.config.ledger_url, count)[0][0] >= billed_before + 2, timeout=20)
    billed = ledger_rows(server.config.ledger_url, "SELECT request_id FROM usage_records")
    assert ("over-cap-1",) not in billed and len(billed) >= billed_before + 2


def test_past_its_calls_per_second_a_tenant_is_refused_with_the_time_of_its_next_call(server):
    set_policy(server, "acme", calls_per_s=1)
    try:
        stub = server.stub()
        errors_seen = [e for e in (refused_for_quota(server, stub) for _ in range(4)) if e is not None]
        assert errors_seen, "four calls in a row within one call per second"
        error = errors_seen[0]
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert status_details(error)["ErrorInfo"].metadata["cap"] == "calls_per_s"
        (violation,) = quota_failure(error).violations
        assert violation.description == "calls_per_s: 1 of 1 used"
        hint_ms = int(dict(error.trailing_metadata())["retry-after-ms"])
        assert 0 < hint_ms <= 1_000 and dict(error.trailing_metadata())["grpc-retry-pushback-ms"] == str(hint_ms)
        generate(server.stub(key=server.other_key))  # another tenant has no cap
        # the SDK waits out the hint on the same replica, then is served
        with Client([server.address], api_key=server.key) as client:
            results = [client.complete("def f(x):", deadline_ms=5_000, max_tokens=2) for _ in range(3)]
        waits = [a.wait_reason for r in results for a in r.report.attempts]
        assert "quota" in waits and all(r.report.endpoint == server.address for r in results)
    finally:
        set_policy(server, "acme", calls_per_s=None)


def test_a_failed_policy_read_keeps_serving_with_the_last_policy(server):
    book, registry = server.replica.book, server.replica.metrics.registry
    read = book.read

    async def down():
        raise ConnectionError("the ledger is down")

    def failed() -> float:
        return registry.get_sample_value("zeroqueue_policy_refreshes_total", {"result": "failed"}) or 0.0

    before, policy = failed(), book.policy
    book.read = down
    try:
        wait_until(lambda: failed() > before, timeout=5)
        assert book.policy is policy
        assert generate(server.stub())[-1].final.usage.sm_us > 0
    finally:
        book.read = read
    ok = registry.get_sample_value("zeroqueue_policy_refreshes_total", {"result": "ok"})
    wait_until(lambda: registry.get_sample_value("zeroqueue_policy_refreshes_total", {"result": "ok"}) > ok)
    assert registry.get_sample_value("zeroqueue_policy_read_timestamp_seconds") > 0


def test_a_replica_on_a_remote_metering_service_reads_the_policy_with_get_serving_policy(llama_dir, tmp_path):
    from tests.inference.test_service_class import INTERACTIVE, add_classes
    from tests.metering.harness import MeteringThread

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    commands.migrate(url)
    tenant_key, admin_key = commands.create_tenant(url, "acme"), commands.create_admin_key(url)
    add_classes(url, INTERACTIVE)
    with ledger(url) as session:
        service_classes.set_tenant_policy(session, "acme", weight=3, calls_per_s=1_000)
    config = ServeConfig(
        str(llama_dir),
        port=0,
        data_dir=str(tmp_path / "replica"),
        executor=ExecutorConfig(max_batch=4, max_seq_len=256),
        policy_refresh_s=0.2,
    )
    with MeteringThread(url) as metering:
        server = ServerThread(dataclasses.replace(config, metering_address=metering.address, metering_key=admin_key))
        try:
            server.start()
            book = server.replica.book
            wait_until(lambda: book.policy.class_named("interactive") is not None, timeout=10)
            assert book.policy.quota_of("acme").calls_per_s == 1_000 and book.policy.weight_of("acme") == 3
            assert server.replica.service.admission.shares.weights == {"acme": 3.0}  # fair share weighs it so
            messages = generate(server.stub(key=tenant_key), timeout=3.0, service_class="interactive")
            assert messages[0].admission.service_class == "interactive"
            ok = server.replica.metrics.registry.get_sample_value("zeroqueue_policy_refreshes_total", {"result": "ok"})
            assert ok >= 1
        finally:
            server.stop()
