"""Record validation and payload digests."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from billing.errors import InvalidRecord
from billing.records import MAX_RECORD_WALL_US, MAX_TOKENS, Door, IdleRecord, Outcome, RequestKind, UsageRecord
from tests.billing.factories import START_US, US_PER_HOUR, gpu_usage, idle, missed, usage


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"call_id": ""}, "call_id"),
        ({"call_id": "x" * 129}, "call_id"),
        ({"call_id": "bad\nid"}, "call_id"),
        ({"request_id": "x" * 129}, "request_id"),
        ({"request_id": "bad\nid"}, "request_id"),
        ({"tenant": "Acme Corp"}, "tenant"),
        ({"labels": {"Team": "x"}}, "labels.Team"),
        ({"labels": {"team": ""}}, "labels.team"),
        ({"labels": {f"k{i}": "v" for i in range(17)}}, "labels"),
        ({"device_kind": "tpu"}, "device_kind"),
        ({"unit": "sm_us"}, "unit"),  # a CPU has no SMs
        ({"device_id": "GPU-123"}, "device_id"),  # a CPU device id is cpu:<host>
        ({"num_units": 0}, "num_units"),
        ({"unit_us": -1}, "unit_us"),
        ({"unit_us": 1.5}, "unit_us"),
        ({"unit_us": True}, "unit_us"),
        ({"unit_us": 2**63}, "unit_us"),
        ({"prompt_tokens": -1}, "prompt_tokens"),
        ({"outcome": "timeout"}, "outcome"),
        ({"request_kind": "voice"}, "request_kind"),
        ({"request_kind": "Chat"}, "request_kind"),  # the values are lower case, as they are stored
        ({"request_kind": None}, "request_kind"),
        ({"door": "websocket"}, "door"),
        ({"door": "HTTP"}, "door"),  # the values are lower case, as they are stored
        ({"door": None}, "door"),
        ({"cached_prompt_tokens": -1}, "cached_prompt_tokens"),
        ({"cached_prompt_tokens": 11}, "cached_prompt_tokens"),  # more than the prompt's 10 tokens
        ({"prompt_tokens": 0, "cached_prompt_tokens": 1}, "cached_prompt_tokens"),
        ({"cached_prompt_tokens": 1.5}, "cached_prompt_tokens"),
        ({"cached_prompt_tokens": True}, "cached_prompt_tokens"),
        ({"cached_prompt_tokens": None}, "cached_prompt_tokens"),
        ({"weight_dtype": "INT8"}, "weight_dtype"),  # the values are lower case, as torch names dtypes
        ({"weight_dtype": "8bit"}, "weight_dtype"),  # a letter first
        ({"weight_dtype": "int8 "}, "weight_dtype"),
        ({"weight_dtype": "x" * 17}, "weight_dtype"),  # the ledger's column holds 16
        ({"weight_dtype": None}, "weight_dtype"),
        ({"deadline_met": 1}, "deadline_met"),
        ({"first_token_at_us": START_US}, "first_token_at_us"),  # before dispatch
        ({"dispatched_at_us": START_US + 10**12}, "first_token_at_us"),
        ({"deadline_at_us": START_US}, "deadline_met"),  # met, yet finished after the deadline
        ({"outcome": "deadline_exceeded"}, "deadline_met"),
    ],
)
def test_invalid_usage_names_the_field(overrides: dict, field: str) -> None:
    overrides = dict(overrides)
    with pytest.raises(InvalidRecord) as caught:
        usage(overrides.pop("call_id", "r-1"), **overrides)
    assert caught.value.field == field
    assert field.split(".")[0] in str(caught.value)


def test_gpu_record_uses_sm_us_and_a_gpu_uuid() -> None:
    assert gpu_usage("r-1").unit == "sm_us"
    with pytest.raises(InvalidRecord) as caught:
        gpu_usage("r-1", unit="core_us")
    assert caught.value.field == "unit"
    with pytest.raises(InvalidRecord) as caught:
        gpu_usage("r-1", device_id="cpu:host")
    assert caught.value.field == "device_id"


def test_ok_outcome_must_agree_with_the_clock() -> None:
    with pytest.raises(InvalidRecord) as caught:
        usage("r-1", deadline_met=False)  # finished before its deadline, outcome ok
    assert caught.value.field == "deadline_met"
    assert not missed("r-2").deadline_met


def test_labels_are_frozen_and_sorted() -> None:
    source = {"team": "b", "cost_center": "a"}
    record = usage("r-1", labels=source)
    source["team"] = "changed"
    assert dict(record.labels) == {"cost_center": "a", "team": "b"}
    with pytest.raises(TypeError):
        record.labels["team"] = "x"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.unit_us = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"minute_start_us": START_US + 1}, "minute_start_us"),
        ({"idle_unit_us": 10, "wall_unit_us": 5}, "idle_unit_us"),
        ({"wall_unit_us": 0}, "wall_unit_us"),
        ({"wall_unit_us": 60_000_000 * 4 + 1}, "wall_unit_us"),
        ({"unit": "sm_us"}, "device_id"),  # a GPU unit on a cpu: device
    ],
)
def test_invalid_idle_names_the_field(overrides: dict, field: str) -> None:
    fields = dataclasses.asdict(idle("cpu:host-a", 0, 100)) | overrides
    with pytest.raises(InvalidRecord) as caught:
        IdleRecord(**fields)
    assert caught.value.field == field


DIGEST_CHANGES = [
    {"call_id": "r-other"},
    {"request_id": "caller-1"},
    {"service_class": "batch"},
    {"request_kind": "chat"},
    {"request_kind": "constrained"},
    {"request_kind": "chat_constrained"},
    {"door": "http"},
    {"cached_prompt_tokens": 1},
    {"cached_prompt_tokens": 10},
    {"tenant": "other"},
    {"labels": {"team": "x"}},
    {"model": "m2"},
    {"device_id": "cpu:host-b"},
    {"num_units": 8},
    {"unit_us": 7},
    {"prompt_tokens": 1},
    {"completion_tokens": 2},
    {"received_at_us": START_US + US_PER_HOUR - 6_000},
    {"dispatched_at_us": START_US + US_PER_HOUR - 4_500},
    {"first_token_at_us": None},
    {"finished_at_us": START_US + US_PER_HOUR + 10},
    {"deadline_at_us": START_US + 10**10},
    {"outcome": "error"},
    {"outcome": "error", "deadline_met": False},
    {"device_kind": "cuda", "unit": "sm_us", "device_id": "GPU-1"},
]


@pytest.mark.parametrize("change", DIGEST_CHANGES, ids=lambda change: "+".join(change))
def test_every_field_changes_the_digest(change: dict) -> None:
    base = usage("r-1")
    assert dataclasses.replace(base, **change).payload_digest() != base.payload_digest()


def test_digest_ignores_label_order_and_enum_spelling() -> None:
    first = usage("r-1", labels={"team": "t", "cost_center": "c"})
    second = usage("r-1", labels={"cost_center": "c", "team": "t"})
    assert first.payload_digest() == second.payload_digest()
    assert len(first.payload_digest()) == 64
    assert usage("r-1", outcome=Outcome.OK).payload_digest() == usage("r-1", outcome="ok").payload_digest()


# Digests computed by the code before issue 30 renamed the fields (request_id -> call_id, client_request_id ->
# request_id): a record in an outbox or the ledger from before must digest the same, or its replay would be a
# CONFLICT instead of a DUPLICATE. These values are frozen; never update them to make a test pass.
DIGESTS_BEFORE_THE_RENAME = [
    ({}, "fecf5d527e15175c916d82dee80b22916b3b69780e7aa23d819a7ae75f557680"),
    ({"request_id": "caller-7"}, "7af65df6fff14e061ca3b177240cf88415e21beed62fb1812c5989e2f491d386"),
    (
        {"request_id": "caller-7", "service_class": "batch"},
        "7ad355cd01de785de0df3e5f631a880fce4064b7a5e9fa02e78067016961811f",
    ),
]


@pytest.mark.parametrize(("fields", "digest"), DIGESTS_BEFORE_THE_RENAME)
def test_a_record_digests_as_it_did_before_its_fields_were_renamed(fields: dict, digest: str) -> None:
    assert usage("call-1", **fields).payload_digest() == digest


# Issue 31 added request_kind: a plain record (every record before it) keeps the digest it had, however its kind is
# spelled, so a record stored or queued before kinds replays as a DUPLICATE. Any other kind digests differently
# (the same call_id with another kind is a CONFLICT); those digests are frozen from here on too.
DIGESTS_OF_REQUEST_KINDS = [
    *(
        (fields | {"request_kind": kind}, digest)
        for fields, digest in DIGESTS_BEFORE_THE_RENAME
        for kind in ("", "plain")
    ),
    ({"request_kind": RequestKind.PLAIN}, DIGESTS_BEFORE_THE_RENAME[0][1]),
    ({"request_kind": "chat"}, "0c6268e7547dad96313fbc7d439f9d5d220e4e6c561d88e3cd7952aed9ef2715"),
    ({"request_kind": "constrained"}, "e5220a26bf73e57ec7bfb23b9f313bd7f762cf43ab2ee614e734796b2e3f4576"),
    ({"request_kind": "chat_constrained"}, "5433425b4adbb2add548afa835d962fba3e85c8b4df31899f2de750f8a65a632"),
]


@pytest.mark.parametrize(("fields", "digest"), DIGESTS_OF_REQUEST_KINDS)
def test_a_plain_record_digests_as_before_kinds_and_another_kind_differently(fields: dict, digest: str) -> None:
    assert usage("call-1", **fields).payload_digest() == digest


def test_a_record_holds_its_request_kind_as_the_enum_and_empty_means_plain() -> None:
    assert usage("r-1").request_kind is RequestKind.PLAIN
    assert usage("r-1", request_kind="").request_kind is RequestKind.PLAIN  # a sender before kinds
    for kind in RequestKind:
        record = usage("r-1", request_kind=kind.value)
        assert record.request_kind is kind
        payload = record.to_payload()
        assert type(payload["request_kind"]) is str and payload["request_kind"] == kind.value
        assert UsageRecord(**payload) == record == UsageRecord.from_v1_payload(record.to_v1_payload())
    v1 = usage("r-1").to_v1_payload()
    del v1["request_kind"]  # queued or stored before kinds
    assert UsageRecord.from_v1_payload(v1).request_kind is RequestKind.PLAIN


# Issue 32 added door: a grpc record (every record before it) keeps the digest it had, however its door is spelled,
# whatever its kind, so a record stored or queued before doors replays as a DUPLICATE. An http record digests
# differently (the same call_id through another door is a CONFLICT); those digests are frozen from here on too.
DIGESTS_OF_DOORS = [
    *((fields | {"door": door}, digest) for fields, digest in DIGESTS_OF_REQUEST_KINDS for door in ("", "grpc")),
    ({"door": Door.GRPC}, DIGESTS_BEFORE_THE_RENAME[0][1]),
    ({"door": "http"}, "57b8852efa18368f5056843b9f6cfe70ca305363fce60b3dca65c1c319d70746"),
    ({"door": "http", "request_kind": "chat"}, "ff636182aa3cd8b9a93fb752a6df58f749cdc298b63977b8e4aeba2d7c635cf3"),
    (
        {"door": "http", "request_id": "caller-7", "service_class": "batch"},
        "13d027ce1a97c38671222828bfe75f0ae43708b41edc7129f8c1d384ce732d74",
    ),
]


@pytest.mark.parametrize(("fields", "digest"), DIGESTS_OF_DOORS)
def test_a_grpc_record_digests_as_before_doors_and_an_http_one_differently(fields: dict, digest: str) -> None:
    assert usage("call-1", **fields).payload_digest() == digest


def test_a_record_holds_its_door_as_the_enum_and_empty_means_grpc() -> None:
    assert usage("r-1").door is Door.GRPC
    assert usage("r-1", door="").door is Door.GRPC  # a sender before doors
    for door in Door:
        record = usage("r-1", door=door.value)
        assert record.door is door
        payload = record.to_payload()
        assert type(payload["door"]) is str and payload["door"] == door.value
        assert UsageRecord(**payload) == record == UsageRecord.from_v1_payload(record.to_v1_payload())
    v1 = usage("r-1", request_kind="chat").to_v1_payload()
    del v1["door"]  # queued or stored before doors
    assert UsageRecord.from_v1_payload(v1) == usage("r-1", request_kind="chat", door=Door.GRPC)


# Issue 33 added cached_prompt_tokens: a record the prefix cache served nothing (every record before it) keeps the
# digest it had, whatever its kind and door, so a record stored or queued before the cache replays as a DUPLICATE.
# Any other count digests differently (the same call_id with another count is a CONFLICT); frozen from here on too.
DIGESTS_OF_CACHED_PROMPT_TOKENS = [
    *((fields | {"cached_prompt_tokens": 0}, digest) for fields, digest in DIGESTS_OF_DOORS),
    ({"cached_prompt_tokens": 4}, "8528d986f7c23a879497619addd35bc798f5f9c7033b9326babfb77cce78aae1"),
    ({"cached_prompt_tokens": 10}, "0263706aa4a9f3d174fa0c9772ac6949655f2e7f3f38041a11bd047ffa7010e0"),
    (
        {"cached_prompt_tokens": 4, "door": "http", "request_kind": "chat"},
        "eebf4586850046351a31d4b659846c82bb902aaa8ad8d2fd352df9c5b4777609",
    ),
]


@pytest.mark.parametrize(("fields", "digest"), DIGESTS_OF_CACHED_PROMPT_TOKENS)
def test_a_record_without_cached_tokens_digests_as_before_the_cache_and_one_with_them_differently(
    fields: dict, digest: str
) -> None:
    assert usage("call-1", **fields).payload_digest() == digest


def test_cached_prompt_tokens_default_to_0_read_back_and_are_bounded_by_the_prompt() -> None:
    assert usage("r-1").cached_prompt_tokens == 0
    for cached in (0, 1, 10):  # the factory's prompt is 10 tokens: all of them may come from the cache
        record = usage("r-1", cached_prompt_tokens=cached)
        assert record.to_payload()["cached_prompt_tokens"] == cached
        assert UsageRecord(**record.to_payload()) == record == UsageRecord.from_v1_payload(record.to_v1_payload())
    v1 = usage("r-1", door="http").to_v1_payload()
    del v1["cached_prompt_tokens"]  # queued or stored before the cache
    assert UsageRecord.from_v1_payload(v1) == usage("r-1", door="http", cached_prompt_tokens=0)
    with pytest.raises(InvalidRecord, match=r"cached_prompt_tokens must be in \[0, 10 \(prompt_tokens\)\], got 11"):
        usage("r-1", cached_prompt_tokens=11)


# Issue 34 added weight_dtype: a record that names none (every record before it, and one from a sender before it)
# keeps the digest it had, so a record stored or queued before it replays as a DUPLICATE. A named dtype digests
# differently (the same call_id with another dtype is a CONFLICT); frozen from here on too.
DIGESTS_OF_WEIGHT_DTYPES = [
    *((fields | {"weight_dtype": ""}, digest) for fields, digest in DIGESTS_OF_CACHED_PROMPT_TOKENS),
    ({"weight_dtype": "int8"}, "2b950bae432fcde5471b45234252bda216bdea5772cfc36198f9b4146ee9bde5"),
    ({"weight_dtype": "bfloat16"}, "f91a54f56f403d0be20a33894c9968be1f4c051e17f29689278385447b3fee0d"),
    (
        {"weight_dtype": "int8", "door": "http", "cached_prompt_tokens": 4},
        "673ac7e6b068ffafc0e17e50bbb45e1243b573419337ec361cd84a9e483a0e9a",
    ),
]


@pytest.mark.parametrize(("fields", "digest"), DIGESTS_OF_WEIGHT_DTYPES)
def test_a_record_without_a_weight_dtype_digests_as_before_and_one_with_it_differently(
    fields: dict, digest: str
) -> None:
    assert usage("call-1", **fields).payload_digest() == digest


def test_weight_dtype_defaults_to_unknown_reads_back_and_a_payload_without_it_is_unknown() -> None:
    assert usage("r-1").weight_dtype == ""
    for dtype in ("", "int8", "bfloat16", "float32", "float8_e4m3fn"):
        record = usage("r-1", weight_dtype=dtype)
        assert record.to_payload()["weight_dtype"] == dtype
        assert UsageRecord(**record.to_payload()) == record == UsageRecord.from_v1_payload(record.to_v1_payload())
    v1 = usage("r-1", door="http", cached_prompt_tokens=2).to_v1_payload()
    del v1["weight_dtype"]  # queued or stored before weight dtypes
    assert UsageRecord.from_v1_payload(v1) == usage("r-1", door="http", cached_prompt_tokens=2, weight_dtype="")
    with pytest.raises(InvalidRecord, match=r"weight_dtype must be '' or 1..16 characters .*got 'INT8'"):
        usage("r-1", weight_dtype="INT8")


def test_an_idle_record_digests_as_it_did_before_the_digest_took_payloads() -> None:
    assert idle("cpu:host-a", 3, 1_000).payload_digest() == (
        "8ebdce8204e30921363d2a416256a5fac2786b09c2ff0aed585544165246ae21"
    )


def test_the_v1_payload_keeps_the_keys_before_the_rename_and_reads_back() -> None:
    record = usage("call-1", request_id="caller-7")
    v1 = record.to_v1_payload()
    assert v1["request_id"] == "call-1" and v1["client_request_id"] == "caller-7" and "call_id" not in v1
    assert UsageRecord.from_v1_payload(v1) == record


@pytest.mark.parametrize("outcome", list(Outcome))
def test_a_record_holds_its_outcome_as_the_enum_and_its_payload_as_the_value(outcome: Outcome) -> None:
    late = START_US + US_PER_HOUR - 1  # the factory's record finishes an hour in
    record = usage("r-1", deadline_at_us=late, deadline_met=False, outcome=outcome.value)
    assert record.outcome is outcome
    assert type(record.to_payload()["outcome"]) is str and record.to_payload()["outcome"] == outcome.value
    assert UsageRecord(**record.to_payload()) == record


@settings(max_examples=200, deadline=None)
@given(
    unit_us=st.integers(0, 4 * MAX_RECORD_WALL_US),  # the factory's num_units is 4
    prompt=st.integers(0, MAX_TOKENS),
    completion=st.integers(0, MAX_TOKENS),
    labels=st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True),
        st.text(
            st.characters(min_codepoint=32, max_codepoint=0x2FFF, exclude_characters="\x7f"), min_size=1, max_size=20
        ),
        max_size=5,
    ),
    gaps=st.lists(st.integers(0, 10**9), min_size=3, max_size=3),
)
def test_valid_records_round_trip_through_their_payload(unit_us, prompt, completion, labels, gaps) -> None:
    received = START_US
    dispatched = received + gaps[0]
    first = dispatched + gaps[1]
    finished = first + gaps[2]
    record = usage(
        "r-h",
        unit_us=unit_us,
        prompt_tokens=prompt,
        completion_tokens=completion,
        labels=labels,
        received_at_us=received,
        dispatched_at_us=dispatched,
        first_token_at_us=first,
        finished_at_us=finished,
        deadline_at_us=finished,
    )
    again = UsageRecord(**record.to_payload())
    assert again == record
    assert again.payload_digest() == record.payload_digest()
