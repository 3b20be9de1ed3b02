"""Seeded Metering calls for fuzzing: a valid request of a method, then a few of its fields set to what a
hostile or broken client sends (huge and negative integers, other digits, NUL bytes, long strings, forged page
tokens, another tenant's names and ids).

Call `index` of a seed is a pure function of the two (its own random.Random), so a failure is made again alone
with `MeteringFuzzer(seed, world).call(index)`. Nothing here talks to a server: tests/metering/test_fuzz.py sends
the calls and checks the replies.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass, field

from google.protobuf.message import Message
from zeroqueue.metering.v1 import metering_pb2 as pb

from billing.page_tokens import encode_page_token

INT32 = (0, 1, -1, 2, 1000, 4096, 4097, 2**31 - 1, -(2**31), 2**30)
INT64 = INT32 + (
    2**31,
    2**32,
    2**53 + 1,
    2**58,
    2**62,
    2**63 - 1,
    -(2**63),
    7_258_118_400_000_000,
    1_614_556_800_000_000,
    10**15,
)
TEXT = (
    "",
    "acme",
    "globex",
    "initech",
    "tiny",
    "2021-03",
    "2026-12",
    "２０２６-１２",
    "٢٠٢٦-١٢",
    "२०२६-१२",
    "2026-１2",
    "2021-03\x00",
    "\x00",
    "a\x00b",
    "acme\x00",
    "x" * 10_000,
    "é" * 5_000,
    "🙂" * 300,
    "\n",
    "\x7f",
    "Acme",
    "a b",
    "../etc",
    "'; DROP TABLE tenants; --",
    "cost_center",
    "team",
    "day",
    "model",
    "tenant",
    "core_us",
    "sm_us",
    "cpu",
    "cuda",
    "cpu:host-a",
    "GPU-0",
    "ok",
    "error",
    "deadline_exceeded",
)
HOSTILE = tuple(t for t in TEXT if "\x00" in t or len(t) > 100 or not t.isascii() or not t.isprintable())
LABEL_KEYS = ("team", "cost_center", "region", "Team", "a\x00", "", "x" * 100, "é", "1abc")


@dataclass
class World:
    """What the fuzzer may aim at: the tenants' invoice ids and page tokens a server issued."""

    own_invoice_ids: list[int] = field(default_factory=list)
    other_invoice_ids: list[int] = field(default_factory=list)
    page_tokens: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class FuzzCall:
    index: int
    method: str
    request: Message
    admin: bool  # sent with the admin key, else with the tenant acme's key
    mutations: tuple[str, ...]


def _valid_record(rng: random.Random) -> pb.UsageRecord:
    finished = 1_614_556_800_000_000 + rng.randrange(10**9)
    return pb.UsageRecord(
        call_id=f"fz-{rng.getrandbits(48):x}",
        tenant="acme",
        labels={"cost_center": "cc-1"},
        model="tiny",
        device_kind="cpu",
        device_id="cpu:host-a",
        unit="core_us",
        num_units=4,
        unit_us=1_000_000,
        prompt_tokens=3,
        completion_tokens=5,
        received_at_us=finished - 50,
        dispatched_at_us=finished - 40,
        first_token_at_us=finished - 30,
        finished_at_us=finished,
        deadline_at_us=finished + 10,
        deadline_met=True,
        outcome="ok",
        weight_dtype=rng.choice(("bfloat16", "int8", "")),
    )


def _valid_idle(rng: random.Random) -> pb.IdleRecord:
    minute = 1_614_556_800_000_000 + rng.randrange(1000) * 60_000_000
    return pb.IdleRecord(
        record_id=f"fz-idle-{rng.getrandbits(48):x}",
        device_id="cpu:host-a",
        unit="core_us",
        num_units=4,
        minute_start_us=minute,
        idle_unit_us=1_000,
        wall_unit_us=240_000_000,
    )


class MeteringFuzzer:
    METHODS = (
        "RecordUsage",
        "QueryUsage",
        "CreateInvoice",
        "FinalizeInvoice",
        "GetInvoice",
        "ListInvoices",
        "GetChargebackReport",
        "WhoAmI",
    )

    def __init__(self, seed: int, world: World) -> None:
        self.seed, self.world = seed, world

    def call(self, index: int) -> FuzzCall:
        rng = random.Random(f"{self.seed}:{index}")
        method = rng.choice(self.METHODS)
        admin = rng.random() < 0.5
        request = self._base(rng, method, admin)
        target = request
        if method == "RecordUsage" and (request.records or request.idle) and rng.random() < 0.8:
            target = rng.choice([*request.records, *request.idle])
        mutations = tuple(self._mutate(rng, target, method) for _ in range(rng.randint(1, 3)))
        return FuzzCall(index, method, request, admin, mutations)

    def _base(self, rng: random.Random, method: str, admin: bool) -> Message:
        invoice_ids = self.world.own_invoice_ids + self.world.other_invoice_ids or [1]
        if method == "RecordUsage":
            return pb.RecordUsageRequest(
                records=[_valid_record(rng) for _ in range(rng.randint(0, 3))],
                idle=[_valid_idle(rng) for _ in range(rng.randint(0, 1))],
            )
        if method == "QueryUsage":
            return pb.QueryUsageRequest(
                page_size=rng.choice((0, 1, 2)), page_token=rng.choice(["", *self.world.page_tokens])
            )
        if method == "CreateInvoice":
            return pb.CreateInvoiceRequest(tenant="acme" if admin else "", period="2021-03")
        if method in ("FinalizeInvoice", "GetInvoice"):
            message = pb.FinalizeInvoiceRequest if method == "FinalizeInvoice" else pb.GetInvoiceRequest
            return message(invoice_id=rng.choice(invoice_ids))
        if method == "ListInvoices":
            return pb.ListInvoicesRequest(period=rng.choice(("", "2021-03")))
        if method == "GetChargebackReport":
            return pb.GetChargebackReportRequest(
                period="2021-03", group_by=rng.sample(("tenant", "model", "day", "weight_dtype"), 2)
            )
        return pb.WhoAmIRequest()

    def _mutate(self, rng: random.Random, message: Message, method: str) -> str:
        fields = message.DESCRIPTOR.fields
        if not fields:
            return "none"
        descriptor = rng.choice(fields)
        name = descriptor.name
        if descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
            getattr(message, name)[rng.choice(LABEL_KEYS)] = rng.choice(TEXT)
        elif descriptor.type == descriptor.TYPE_MESSAGE:
            return "nested"
        elif descriptor.is_repeated:
            getattr(message, name).extend(rng.choice(TEXT) for _ in range(rng.randint(1, 3)))
        elif name == "page_token":
            message.page_token = self._forged_token(rng)
        elif name == "invoice_id":
            message.invoice_id = rng.choice([*self.world.other_invoice_ids, *self.world.own_invoice_ids, *INT64])
        elif descriptor.type == descriptor.TYPE_STRING:
            setattr(message, name, rng.choice(HOSTILE if rng.random() < 0.5 else TEXT))
        elif descriptor.type == descriptor.TYPE_BOOL:
            setattr(message, name, not getattr(message, name))
        elif descriptor.type in (descriptor.TYPE_INT32, descriptor.TYPE_UINT32):
            setattr(message, name, rng.choice(INT32))
        else:
            setattr(message, name, rng.choice(INT64))
        return f"{method}.{name}"

    def _forged_token(self, rng: random.Random) -> str:
        real = rng.choice(self.world.page_tokens or ["e30.AAAA"])
        body, _, tag = real.partition(".")
        unsigned = base64.urlsafe_b64encode(json.dumps({"v": 1, "q": "0" * 16, "after": [2**70, 2**63]}).encode())
        return rng.choice(
            (
                real,
                f"{body}.{tag[::-1]}",
                body,
                unsigned.decode().rstrip("="),
                base64.b64encode(rng.randbytes(40)).decode(),
                encode_page_token(rng.randbytes(32), "0" * 16, 2**63 - 1, 2**63 - 1),
                "x" * 600,
                "é.é",
                "..",
            )
        )
