"""Idempotent ingest and usage queries, on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from structlog.testing import capture_logs

from billing.db import unit_of_work
from billing.errors import InvalidArgument, InvalidPageToken, UnknownTenant
from billing.ledger import IngestStatus, ingest_idle, ingest_usage, query_usage
from billing.models import IdleRow, UsageConflict, UsageRow
from billing.period import parse_period
from billing.records import MAX_RECORD_WALL_US, MAX_TOKENS, Door, RequestKind
from billing.tenants import create_tenant
from tests.billing.conftest import Ledger
from tests.billing.factories import PERIOD, START_US, US_PER_HOUR, idle, usage

PERIOD_BOUNDS = parse_period(PERIOD)


@pytest.fixture
def acme(ledger: Ledger) -> Ledger:
    with unit_of_work(ledger.sessions) as session:
        create_tenant(session, "acme")
        create_tenant(session, "globex")
    return ledger


def count(ledger: Ledger, model: type) -> int:
    with ledger.sessions() as session:
        return session.scalar(select(func.count()).select_from(model))


def test_a_record_replayed_1000_times_is_stored_once(acme: Ledger) -> None:
    record = usage("r-replayed")
    statuses = []
    for _ in range(1000):
        with unit_of_work(acme.sessions) as session:
            statuses.extend(result.status for result in ingest_usage(session, [record]))
    assert statuses[0] is IngestStatus.ACCEPTED
    assert set(statuses[1:]) == {IngestStatus.DUPLICATE}
    assert count(acme, UsageRow) == 1
    assert count(acme, UsageConflict) == 0


def test_same_id_different_payload_is_a_recorded_conflict_never_an_overwrite(acme: Ledger) -> None:
    original = usage("r-1", unit_us=1_000)
    tampered = dataclasses.replace(original, unit_us=999_999)
    with unit_of_work(acme.sessions) as session:
        ingest_usage(session, [original])
    with capture_logs() as logs, unit_of_work(acme.sessions) as session:
        [result] = ingest_usage(session, [tampered])
        ingest_usage(session, [tampered])  # the same conflict again is recorded once
    assert result.status is IngestStatus.CONFLICT and not result.delivered
    assert result.stored_digest == original.payload_digest()
    assert [entry["event"] for entry in logs] == ["ledger.conflict", "ledger.conflict"]
    assert logs[0]["log_level"] == "error" and logs[0]["record_id"] == "r-1"
    with acme.sessions() as session:
        stored = session.scalars(select(UsageRow)).one()
        conflict = session.scalars(select(UsageConflict)).one()
    assert stored.unit_us == 1_000 and stored.payload_digest == original.payload_digest()
    assert conflict.record_id == "r-1" and conflict.record_kind == "usage"
    assert conflict.stored_digest == original.payload_digest()
    assert conflict.rejected_digest == tampered.payload_digest()
    assert conflict.rejected_payload["unit_us"] == 999_999


def test_copies_inside_one_batch_resolve_against_the_first(acme: Ledger) -> None:
    first = usage("r-1")
    batch = [first, usage("r-2"), first, dataclasses.replace(first, unit_us=5)]
    with unit_of_work(acme.sessions) as session:
        results = ingest_usage(session, batch)
    assert [(r.record_id, r.status) for r in results] == [
        ("r-1", IngestStatus.ACCEPTED),
        ("r-2", IngestStatus.ACCEPTED),
        ("r-1", IngestStatus.DUPLICATE),
        ("r-1", IngestStatus.CONFLICT),
    ]
    assert count(acme, UsageRow) == 2 and count(acme, UsageConflict) == 1


def test_the_same_call_with_another_request_kind_is_a_conflict(acme: Ledger) -> None:
    chat = usage("r-chat", request_kind=RequestKind.CHAT)
    plain = usage("r-plain")
    with unit_of_work(acme.sessions) as session:
        assert [r.status for r in ingest_usage(session, [chat, plain])] == [IngestStatus.ACCEPTED] * 2
    with unit_of_work(acme.sessions) as session:
        replays = ingest_usage(
            session,
            [
                chat,
                dataclasses.replace(chat, request_kind=RequestKind.CHAT_CONSTRAINED),
                dataclasses.replace(chat, request_kind=RequestKind.PLAIN),
                dataclasses.replace(plain, request_kind=""),  # a sender before kinds: plain, the same record
                dataclasses.replace(plain, request_kind=RequestKind.CONSTRAINED),
            ],
        )
    assert [r.status for r in replays] == [
        IngestStatus.DUPLICATE,
        IngestStatus.CONFLICT,
        IngestStatus.CONFLICT,
        IngestStatus.DUPLICATE,
        IngestStatus.CONFLICT,
    ]
    with acme.sessions() as session:
        stored = dict(session.execute(select(UsageRow.call_id, UsageRow.request_kind)).all())
        rejected = [c.rejected_payload["request_kind"] for c in session.scalars(select(UsageConflict))]
    assert stored == {"r-chat": "chat", "r-plain": "plain"}  # never overwritten
    assert sorted(rejected) == ["chat_constrained", "constrained", "plain"]


def test_the_same_call_through_another_door_is_a_conflict(acme: Ledger) -> None:
    http = usage("r-http", door=Door.HTTP, request_kind=RequestKind.CHAT)
    grpc = usage("r-grpc", request_kind=RequestKind.CHAT)
    with unit_of_work(acme.sessions) as session:
        assert [r.status for r in ingest_usage(session, [http, grpc])] == [IngestStatus.ACCEPTED] * 2
    with unit_of_work(acme.sessions) as session:
        replays = ingest_usage(
            session,
            [
                http,
                dataclasses.replace(http, door=Door.GRPC),
                dataclasses.replace(grpc, door=""),  # a sender before doors: grpc, the same record
                dataclasses.replace(grpc, door=Door.HTTP),
            ],
        )
    assert [r.status for r in replays] == [
        IngestStatus.DUPLICATE,
        IngestStatus.CONFLICT,
        IngestStatus.DUPLICATE,
        IngestStatus.CONFLICT,
    ]
    with acme.sessions() as session:
        stored = dict(session.execute(select(UsageRow.call_id, UsageRow.door)).all())
        rejected = {c.record_id: c.rejected_payload["door"] for c in session.scalars(select(UsageConflict))}
    assert stored == {"r-http": "http", "r-grpc": "grpc"}  # never overwritten
    assert rejected == {"r-http": "grpc", "r-grpc": "http"}


def test_a_record_per_door_reads_back_with_its_door(acme: Ledger) -> None:
    records = [usage(f"r-{door.value}", door=door, finished_at_us=START_US + i) for i, door in enumerate(Door)]
    with unit_of_work(acme.sessions) as session:
        ingest_usage(session, records)
    with acme.sessions() as session:
        page = query_usage(session, start_us=START_US, end_us=START_US + len(records))
    assert page.records == records
    assert [record.door for record in page.records] == list(Door)


def test_the_same_call_with_another_cached_prompt_token_count_is_a_conflict(acme: Ledger) -> None:
    hit = usage("r-hit", cached_prompt_tokens=8)  # 8 of its 10 prompt tokens served by the prefix cache
    miss = usage("r-miss")
    with unit_of_work(acme.sessions) as session:
        assert [r.status for r in ingest_usage(session, [hit, miss])] == [IngestStatus.ACCEPTED] * 2
    with unit_of_work(acme.sessions) as session:
        replays = ingest_usage(
            session,
            [
                hit,
                dataclasses.replace(hit, cached_prompt_tokens=0),
                dataclasses.replace(miss, cached_prompt_tokens=0),  # a sender before the cache: 0, the same record
                dataclasses.replace(miss, cached_prompt_tokens=10),
            ],
        )
    assert [r.status for r in replays] == [
        IngestStatus.DUPLICATE,
        IngestStatus.CONFLICT,
        IngestStatus.DUPLICATE,
        IngestStatus.CONFLICT,
    ]
    with acme.sessions() as session:
        stored = dict(session.execute(select(UsageRow.call_id, UsageRow.cached_prompt_tokens)).all())
        rejected = {
            c.record_id: c.rejected_payload.get("cached_prompt_tokens") for c in session.scalars(select(UsageConflict))
        }
        page = query_usage(session, start_us=START_US, end_us=START_US + 2 * US_PER_HOUR)
    assert stored == {"r-hit": 8, "r-miss": 0}  # never overwritten
    assert rejected == {"r-hit": 0, "r-miss": 10}
    assert sorted(page.records, key=lambda r: r.call_id) == [hit, miss]


def test_unknown_tenant_is_typed_and_writes_nothing(acme: Ledger) -> None:
    with pytest.raises(UnknownTenant) as caught, unit_of_work(acme.sessions) as session:
        ingest_usage(session, [usage("r-1"), usage("r-2", tenant="initech")])
    assert caught.value.tenant == "initech" and caught.value.field == "tenant"
    assert count(acme, UsageRow) == 0


def test_a_failed_transaction_leaves_the_id_free_for_the_retry(acme: Ledger) -> None:
    """OpenMeter #5118: an id must never be claimed by a write that did not commit."""
    record = usage("r-1")
    with pytest.raises(RuntimeError), unit_of_work(acme.sessions) as session:
        ingest_usage(session, [record])
        raise RuntimeError("ledger write failed after the insert")
    with unit_of_work(acme.sessions) as session:
        [retry] = ingest_usage(session, [record])
    assert retry.status is IngestStatus.ACCEPTED
    assert count(acme, UsageRow) == 1


def test_idle_records_are_idempotent_too(acme: Ledger) -> None:
    record = idle("cpu:host-a", 0, 1_000)
    with unit_of_work(acme.sessions) as session:
        first = ingest_idle(session, [record, idle("cpu:host-a", 1, 0)])
        again = ingest_idle(session, [record, dataclasses.replace(record, idle_unit_us=2_000)])
    assert [r.status for r in first] == [IngestStatus.ACCEPTED] * 2
    assert [r.status for r in again] == [IngestStatus.DUPLICATE, IngestStatus.CONFLICT]
    assert count(acme, IdleRow) == 2
    with acme.sessions() as session:
        assert session.scalar(select(UsageConflict.record_kind)) == "idle"


def test_concurrent_overlapping_batches_store_each_record_once(acme: Ledger) -> None:
    records = [usage(f"r-{i:04d}", finished_at_us=START_US + i) for i in range(600)]
    outcomes: list[list] = [[], []]
    errors: list[BaseException] = []

    def worker(index: int, ids: range) -> None:
        mine = [records[i] for i in ids]
        random.Random(index).shuffle(mine)  # different orders in the two threads
        try:
            for start in range(0, len(mine), 50):
                with unit_of_work(acme.sessions) as session:
                    outcomes[index].extend(ingest_usage(session, mine[start : start + 50]))
        except BaseException as error:  # surfaced by the assertion below
            errors.append(error)

    threads = [
        threading.Thread(target=worker, args=(0, range(0, 450))),
        threading.Thread(target=worker, args=(1, range(150, 600))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    results = outcomes[0] + outcomes[1]
    accepted = [r.record_id for r in results if r.status is IngestStatus.ACCEPTED]
    assert sorted(accepted) == sorted(r.call_id for r in records)  # each accepted exactly once
    assert {r.status for r in results} <= {IngestStatus.ACCEPTED, IngestStatus.DUPLICATE}
    assert count(acme, UsageRow) == 600


def ingest(ledger: Ledger, records: list) -> None:
    with unit_of_work(ledger.sessions) as session:
        ingest_usage(session, records)


def all_pages(ledger: Ledger, page_size: int, **filters) -> list[list[str]]:
    pages, token = [], None
    while True:
        with ledger.sessions() as session:
            page = query_usage(
                session,
                start_us=PERIOD_BOUNDS.start_us,
                end_us=PERIOD_BOUNDS.end_us,
                page_size=page_size,
                page_token=token,
                **filters,
            )
        pages.append([record.call_id for record in page.records])
        token = page.next_page_token
        if token is None:
            return pages


def test_query_pages_cover_every_row_once_in_time_order(acme: Ledger) -> None:
    # Equal finish times exercise the id tie-break of the keyset.
    records = [usage(f"r-{i:02d}", finished_at_us=START_US + 1_000 * (i // 3)) for i in range(23)]
    ingest(acme, list(reversed(records)) + [usage("r-late", finished_at_us=PERIOD_BOUNDS.end_us)])
    pages = all_pages(acme, 5)
    assert [len(page) for page in pages] == [5, 5, 5, 5, 3]
    flat = list(itertools.chain.from_iterable(pages))
    assert sorted(flat) == [r.call_id for r in records]  # r-late is outside the period
    with acme.sessions() as session:
        finished = dict(session.execute(select(UsageRow.call_id, UsageRow.finished_at_us)).all())
    assert [finished[i] for i in flat] == sorted(finished[i] for i in flat)


def test_query_filters_by_tenant_labels_and_model(acme: Ledger) -> None:
    ingest(
        acme,
        [
            usage("a-1"),
            usage("a-2", labels={"team": "ads", "region": "eu"}),
            usage("a-3", model="big"),
            usage("g-1", tenant="globex", labels={"team": "ads", "region": "eu"}),
        ],
    )
    assert all_pages(acme, 10, tenant="acme") == [["a-1", "a-2", "a-3"]]
    assert sorted(all_pages(acme, 10, labels={"team": "ads"})[0]) == ["a-2", "g-1"]
    assert all_pages(acme, 10, tenant="acme", labels={"region": "eu"}) == [["a-2"]]
    assert all_pages(acme, 10, labels={"cost_center": "cc-1"}, model="big") == [["a-3"]]
    with acme.sessions() as session:
        [stored] = query_usage(
            session,
            start_us=PERIOD_BOUNDS.start_us,
            end_us=PERIOD_BOUNDS.end_us,
            labels={"region": "eu"},
            tenant="globex",
        ).records
    assert stored == usage("g-1", tenant="globex", labels={"team": "ads", "region": "eu"})


def test_page_tokens_are_checked(acme: Ledger) -> None:
    ingest(acme, [usage(f"r-{i}", finished_at_us=START_US + i) for i in range(3)])
    bounds = dict(start_us=PERIOD_BOUNDS.start_us, end_us=PERIOD_BOUNDS.end_us)
    with acme.sessions() as session:
        token = query_usage(session, page_size=1, **bounds).next_page_token
        with pytest.raises(InvalidPageToken, match="different filters") as caught:
            query_usage(session, page_size=1, page_token=token, model="other", **bounds)
        assert caught.value.field == "page_token"
        with pytest.raises(InvalidPageToken):
            query_usage(session, page_token="not-a-token", **bounds)
        with pytest.raises(InvalidArgument) as caught:
            query_usage(session, page_size=0, **bounds)
        assert caught.value.field == "page_size"
        with pytest.raises(UnknownTenant):
            query_usage(session, tenant="initech", **bounds)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    unit_us=st.integers(0, 4 * MAX_RECORD_WALL_US),  # the factory's num_units is 4
    tokens=st.integers(0, MAX_TOKENS),
    label=st.text(
        st.characters(min_codepoint=32, max_codepoint=0x10FFFF, exclude_categories=("Cs",), exclude_characters="\x7f"),
        min_size=1,
        max_size=40,
    ),
    call_id=st.text(
        st.characters(min_codepoint=33, max_codepoint=0x2FFF, exclude_characters="\x7f"), min_size=1, max_size=128
    ),
    streamed=st.booleans(),
    kind=st.sampled_from(RequestKind),
    door=st.sampled_from(Door),
    cached_share=st.sampled_from([0, 1, 2]),  # none, half, all of the prompt from the prefix cache
    weight_dtype=st.sampled_from(["", "int8", "bfloat16", "float32"]),  # '': unknown (a sender before it)
)
def test_stored_records_read_back_identical(
    acme: Ledger, unit_us, tokens, label, call_id, streamed, kind, door, cached_share, weight_dtype
) -> None:
    record = usage(
        call_id,
        request_id=call_id[::-1],  # the caller's, beside the call's own
        request_kind=kind,
        door=door,
        unit_us=unit_us,
        prompt_tokens=tokens,
        cached_prompt_tokens=tokens * cached_share // 2,
        weight_dtype=weight_dtype,
        labels={"team": label, "note": label},
        first_token_at_us=START_US + 3_600_000_000 - 3_000 if streamed else None,
    )
    with unit_of_work(acme.sessions) as session:
        ingest_usage(session, [record])
        page = query_usage(
            session,
            start_us=record.finished_at_us,
            end_us=record.finished_at_us + 1,
            labels={"team": label, "note": label},
        )
        replay = ingest_usage(session, [page.records[0]])
        session.rollback()
    assert page.records == [record]
    assert replay[0].status is IngestStatus.DUPLICATE
