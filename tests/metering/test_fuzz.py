"""Seeded hostile Metering calls (tests/metering/fuzz_calls.py) on SQLite and PostgreSQL, with the admin key and
a tenant's: no call is answered INTERNAL (or UNKNOWN), and no reply to the tenant holds another tenant's data."""

from __future__ import annotations

import random

import grpc
import pytest
from zeroqueue.metering.v1 import metering_pb2 as pb

from billing.db import unit_of_work
from billing.ledger import ingest_idle, ingest_usage
from billing.period import parse_period
from tests.billing.conftest import Ledger
from tests.billing.factories import idle, usage
from tests.fuzz_wire import delimited, tag, varint
from tests.metering.conftest import Keys, bearer
from tests.metering.fuzz_calls import FuzzCall, MeteringFuzzer, World

NUM_CALLS = 600
SEED = 20261202
START_US = parse_period("2021-03").start_us
SECRETS = (b"globex-secret", b"globex-cc")  # only ever in globex's records: never sent by the fuzzer
BUGS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}


@pytest.fixture
def world(stub, keys: Keys, ledger: Ledger) -> World:
    with unit_of_work(ledger.sessions) as session:
        ingest_usage(
            session,
            [usage(f"a-{i}", finished_at_us=START_US + i) for i in range(3)]
            + [
                usage(
                    f"globex-secret-{i}",
                    tenant="globex",
                    labels={"cost_center": "globex-cc"},
                    finished_at_us=START_US + 10 + i,
                )
                for i in range(3)
            ],
        )
        ingest_idle(session, [idle("cpu:host-a", 0, 1_000, start_us=START_US)])
    world = World()
    for key, tenant, ids in (
        (keys.admin, "acme", world.own_invoice_ids),
        (keys.admin, "globex", world.other_invoice_ids),
    ):
        for period in ("2021-03", "2021-02"):
            ids.append(
                stub.CreateInvoice(pb.CreateInvoiceRequest(tenant=tenant, period=period), metadata=bearer(key)).id
            )
    for key in (keys.admin, keys.acme):
        world.page_tokens.append(
            stub.QueryUsage(pb.QueryUsageRequest(page_size=1), metadata=bearer(key)).next_page_token
        )
    return world


def leaks(call: FuzzCall, reply: bytes) -> list[str]:
    """What of another tenant a reply to the tenant acme holds."""
    found = [secret.decode() for secret in SECRETS if secret in reply]
    if b"globex" in reply and b"globex" not in call.request.SerializeToString():  # not an echo of the request
        found.append("globex")
    return found


def check_tenant_reply(call: FuzzCall, reply) -> list[str]:  # type: ignore[no-untyped-def]
    problems = leaks(call, reply.SerializeToString())
    if isinstance(reply, pb.QueryUsageResponse):
        problems += [f"record of {r.tenant}" for r in reply.records if r.tenant != "acme"]
    if isinstance(reply, (pb.Invoice, pb.ListInvoicesResponse)):
        problems += [f"invoice of {i.tenant}" for i in getattr(reply, "invoices", [reply]) if i.tenant != "acme"]
    if isinstance(reply, pb.ChargebackReport):
        problems += [f"row of {dict(r.group)}" for r in reply.rows if dict(r.group).get("tenant", "acme") != "acme"]
        problems += ["device utilisation"] if reply.devices else []
    return problems


def test_hostile_calls_are_never_internal_and_never_show_a_tenant_another_tenants_data(
    stub, keys: Keys, world: World
) -> None:
    fuzzer, failures, codes = MeteringFuzzer(SEED, world), [], {}
    for index in range(NUM_CALLS):
        call = fuzzer.call(index)
        key = keys.admin if call.admin else keys.acme
        try:
            reply = getattr(stub, call.method)(call.request, metadata=bearer(key), timeout=30)
        except grpc.RpcError as error:
            codes[error.code().name] = codes.get(error.code().name, 0) + 1
            if error.code() in BUGS:
                failures.append((index, call.mutations, error.code().name, error.details()))
            elif not call.admin and (
                found := leaks(call, (error.details() or "").encode() + repr(error.trailing_metadata()).encode())
            ):
                failures.append((index, call.mutations, "leak", found))
            continue
        codes["OK"] = codes.get("OK", 0) + 1
        if not call.admin and (found := check_tenant_reply(call, reply)):
            failures.append((index, call.mutations, "leak", found))
    assert failures == [], failures[:5]
    assert codes.get("OK", 0) > NUM_CALLS // 10 and codes.get("INVALID_ARGUMENT", 0) > NUM_CALLS // 10, codes
    assert codes.get("PERMISSION_DENIED", 0) > 0, codes


def test_a_call_is_made_again_alone_from_its_seed_and_index(world: World) -> None:
    first, again = MeteringFuzzer(SEED, world).call(17), MeteringFuzzer(SEED, world).call(17)
    assert (first.method, first.request, first.admin, first.mutations) == (
        again.method,
        again.request,
        again.admin,
        again.mutations,
    )


def test_every_usage_record_field_is_mutated_weight_dtype_included(world: World) -> None:
    fuzzer = MeteringFuzzer(SEED, world)
    mutated = {m for index in range(NUM_CALLS) for m in fuzzer.call(index).mutations}
    assert "RecordUsage.weight_dtype" in mutated
    assert {f"RecordUsage.{f.name}" for f in pb.UsageRecord.DESCRIPTOR.fields} - mutated - {
        "RecordUsage.labels"
    } == set()


# raw-bytes mutations of a valid RecordUsageRequest: each of its records says a weight_dtype (field 24)
WEIGHT_DTYPE = pb.UsageRecord.DESCRIPTOR.fields_by_name["weight_dtype"].number
RECORDS = pb.RecordUsageRequest.DESCRIPTOR.fields_by_name["records"].number


def _raw_record_usage(rng: random.Random) -> bytes:
    raw = MeteringFuzzer(SEED, World())._base(rng, "RecordUsage", admin=True).SerializeToString()
    record = pb.UsageRecord(call_id=f"raw-{rng.getrandbits(32):x}", tenant="acme", model="tiny").SerializeToString()
    value = rng.choice((b"\xff", b"int\xc0\xaf8", b"x" * 100_000, b"int8\x00", "ｉｎｔ８".encode()))
    mutations = (
        lambda: raw + delimited(RECORDS, record + delimited(WEIGHT_DTYPE, value)),  # not UTF-8, huge, NUL, wide
        lambda: raw + delimited(RECORDS, record + tag(WEIGHT_DTYPE, 0) + varint(rng.getrandbits(40))),  # wire type
        lambda: raw + delimited(RECORDS, record + tag(WEIGHT_DTYPE, 2) + varint(2**20)),  # length past the end
        lambda: bytes(b ^ (1 << rng.randrange(8)) if rng.random() < 0.02 else b for b in raw),  # bits flipped
        lambda: raw[: rng.randrange(len(raw) + 1)],  # cut
    )
    return rng.choice(mutations)()


def test_raw_bytes_record_usage_is_never_internal_and_the_server_stays_up(metering, keys: Keys) -> None:
    with metering.channel() as channel:
        call = channel.unary_unary("/zeroqueue.metering.v1.Metering/RecordUsage")  # bytes in, bytes out
        codes = {}
        for index in range(200):
            try:
                call(_raw_record_usage(random.Random(f"raw:{index}")), metadata=bearer(keys.admin), timeout=30)
                codes["OK"] = codes.get("OK", 0) + 1
            except grpc.RpcError as error:
                assert error.code() not in BUGS, (index, error.code(), error.details())
                codes[error.code().name] = codes.get(error.code().name, 0) + 1
        assert codes.get("INVALID_ARGUMENT", 0) > 0, codes
        assert metering.stub(channel).WhoAmI(pb.WhoAmIRequest(), metadata=bearer(keys.admin), timeout=10)
