"""Ledger benchmark: ingest throughput, and invoice + chargeback time over 1,000,000 usage records.

    .venv/bin/python bench/ledger.py                      # SQLite (temp file) and PostgreSQL (fresh schema)
    .venv/bin/python bench/ledger.py --records 20000 --big 1000000 --postgres URL

Ingest: ``--records`` distinct usage records in batches of ``--batch`` (500),
one unit of work (one commit) per batch, through each path in INGEST_PATHS;
then the same records again (all duplicates).  Side by side, in the same run,
a bare ``INSERT`` of equally many rows without the idempotency check gives
the ratio that isolates what ``ingest_usage`` adds.

Reports: ``--big`` rows are generated inside the database (INSERT … SELECT
over generate_series / a recursive CTE) into one month, spread over 4
tenants, 3 models (two on a CPU, one on a GPU), 20 cost centers, 10 teams
and every day, 5 % missing their deadline, with a month of per-minute idle
records for two devices.  Their ``payload_digest`` is a placeholder: they
are for aggregation timing, never ingested.  Then each tenant's invoice is
generated and the chargeback report is computed by several groupings.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from ledger_bulk import BIG_MONTH, NUM_TENANTS, analyze, generate_idle, generate_usage
from sqlalchemy import create_engine, func, insert, select, text
from sqlalchemy.engine import make_url

import migrations
from billing.chargeback import chargeback_report
from billing.db import make_engine, session_factory, unit_of_work
from billing.invoices import create_or_refresh_draft
from billing.ledger import ingest_usage
from billing.models import UsageRow
from billing.period import parse_period
from billing.pricing import add_price
from billing.records import UsageRecord
from billing.render import render_chargeback
from billing.tenants import create_admin_key, create_tenant
from services.logs import configure_logging

ROOT = Path(__file__).resolve().parents[1]
INGEST_MONTH = "2026-08"
MODELS = (("m-tiny", "core_us"), ("m-small", "core_us"), ("m-big", "sm_us"))

# An ingest path delivers every record of every batch to the ledger at `url`; it is timed end to end.
IngestPath = Callable[[str, list[list[UsageRecord]]], None]


def direct_ingest(url: str, batches: list[list[UsageRecord]]) -> None:
    """billing.ledger.ingest_usage in-process: one unit of work per batch."""
    engine = make_engine(url)
    sessions = session_factory(engine)
    try:
        for batch in batches:
            with unit_of_work(sessions) as session:
                results = ingest_usage(session, batch)
            assert all(result.delivered for result in results)
    finally:
        engine.dispose()


def grpc_ingest(url: str, batches: list[list[UsageRecord]]) -> None:
    """Metering.RecordUsage on a loopback port, like the outbox shipper: one call per batch, each acknowledged
    before the next is sent. Timed end to end: service start (about 0.1 s), protobuf encoding, auth, ingest."""
    from zeroqueue.metering.v1 import metering_pb2 as pb

    from services.metering.servicer import usage_to_pb

    if str(ROOT) not in sys.path:  # the in-process harness lives under tests/, which is not installed
        sys.path.insert(0, str(ROOT))
    from tests.metering.harness import MeteringThread

    engine = make_engine(url)
    try:
        with unit_of_work(session_factory(engine)) as session:
            metadata = (("authorization", f"Bearer {create_admin_key(session).key}"),)
    finally:
        engine.dispose()
    delivered = {pb.RECORD_STATUS_ACCEPTED, pb.RECORD_STATUS_DUPLICATE}
    with MeteringThread(url) as server, server.channel() as channel:
        stub = server.stub(channel)
        for batch in batches:
            request = pb.RecordUsageRequest(records=[usage_to_pb(record) for record in batch])
            reply = stub.RecordUsage(request, metadata=metadata, timeout=120)
            assert all(result.status in delivered for result in reply.records)


# Each path is timed end to end: deliver every record of `batches` to the ledger at `url`, wait for every ack.
INGEST_PATHS: Mapping[str, IngestPath] = MappingProxyType({"direct": direct_ingest, "gRPC": grpc_ingest})


@dataclass
class Timer:
    seconds: float = 0.0


@contextmanager
def timed() -> Iterator[Timer]:
    timer = Timer()
    start = time.perf_counter()
    yield timer
    timer.seconds = time.perf_counter() - start


@contextmanager
def fresh_ledger(backend: str, postgres_url: str) -> Iterator[str]:
    """A migrated, empty ledger: a temp SQLite file, or a new PostgreSQL schema dropped afterwards."""
    if backend == "sqlite":
        directory = tempfile.mkdtemp(prefix="zq-bench-")
        url = f"sqlite+pysqlite:///{directory}/ledger.db"
        try:
            migrations.upgrade(url)
            yield url
        finally:
            shutil.rmtree(directory)
        return
    schema = f"zq_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f"CREATE SCHEMA {schema}"))
    url = make_url(postgres_url).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        migrations.upgrade(url.render_as_string(hide_password=False))
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


def seed(url: str) -> None:
    engine = make_engine(url)
    try:
        with unit_of_work(session_factory(engine)) as session:
            for index in range(NUM_TENANTS):
                create_tenant(session, f"tenant-{index}")
            for model, unit in MODELS:
                add_price(session, model, unit, 1_500 if unit == "core_us" else 40, "USD", 0)
    finally:
        engine.dispose()


def make_records(count: int, prefix: str) -> list[UsageRecord]:
    start_us = parse_period(INGEST_MONTH).start_us
    records = []
    for i in range(count):
        model, unit = MODELS[i % len(MODELS)]
        gpu = unit == "sm_us"
        finished = start_us + 1_000_000 + i * 1_000
        records.append(
            UsageRecord(
                call_id=f"{prefix}-{i:08d}",
                tenant=f"tenant-{i % NUM_TENANTS}",
                labels={"cost_center": f"cc-{i % 20}", "team": f"team-{i % 10}"},
                model=model,
                device_kind="cuda" if gpu else "cpu",
                device_id="GPU-bench" if gpu else "cpu:bench",
                unit=unit,
                num_units=132 if gpu else 4,
                unit_us=1_000 + i % 997 * 1_000,
                prompt_tokens=i % 500,
                completion_tokens=i % 200,
                received_at_us=finished - 50_000,
                dispatched_at_us=finished - 40_000,
                first_token_at_us=finished - 30_000,
                finished_at_us=finished,
                deadline_at_us=finished + 10_000,
                deadline_met=True,
                outcome="ok",
            )
        )
    return records


def batched(records: list[UsageRecord], size: int) -> list[list[UsageRecord]]:
    return [records[start : start + size] for start in range(0, len(records), size)]


def bare_insert(url: str, batches: list[list[UsageRecord]]) -> None:
    """The floor: the same rows INSERTed with no digest, no ON CONFLICT, no duplicate check."""
    engine = make_engine(url)
    sessions = session_factory(engine)
    try:
        for batch in batches:
            rows = []
            for record in batch:
                row = record.to_payload()
                del row["tenant"]
                row.update(
                    call_id="bare-" + record.call_id,
                    tenant_id=1,
                    cost_center=record.cost_center,
                    team=record.team,
                    payload_digest="-",
                    ingested_at_us=0,
                )
                rows.append(row)
            with unit_of_work(sessions) as session:
                session.execute(insert(UsageRow.__table__), rows)
    finally:
        engine.dispose()


def bench_ingest(url: str, count: int, batch_size: int) -> dict[str, float]:
    results: dict[str, float] = {}
    for name, path in INGEST_PATHS.items():
        batches = batched(make_records(count, name), batch_size)
        with timed() as first:
            path(url, batches)
        with timed() as replay:
            path(url, batches)
        results[f"{name} records/s"] = count / first.seconds
        results[f"{name} replay records/s"] = count / replay.seconds
    with timed() as floor:
        bare_insert(url, batched(make_records(count, "floor"), batch_size))
    results["bare INSERT records/s"] = count / floor.seconds
    return results


def bench_reports(url: str, count: int) -> dict[str, float]:
    engine = make_engine(url)
    sessions = session_factory(engine)
    now_us = time.time_ns() // 1_000
    results: dict[str, float] = {}
    try:
        with timed() as load:
            generate_usage(engine, count, now_us)
            generate_idle(engine, now_us)
            analyze(engine)
        results["bulk load s"] = load.seconds
        with sessions() as session:
            assert session.scalar(select(func.count()).select_from(UsageRow)) >= count
        with timed() as all_invoices:
            for index in range(NUM_TENANTS):
                with unit_of_work(sessions) as session:
                    invoice = create_or_refresh_draft(session, f"tenant-{index}", BIG_MONTH)
                    assert sum(line.num_requests for line in invoice.lines if line.kind == "usage") > 0
        results[f"invoices, {NUM_TENANTS} tenants ({count:,} rows) s"] = all_invoices.seconds
        with timed() as refresh:
            with unit_of_work(sessions) as session:
                create_or_refresh_draft(session, "tenant-0", BIG_MONTH)
        results[f"refresh one draft ({count // NUM_TENANTS:,} rows) s"] = refresh.seconds
        for by in (["cost_center"], ["team", "day"], ["model", "tenant"]):
            with timed() as report:
                with sessions() as session:
                    built = chargeback_report(session, BIG_MONTH, by)
            results[f"chargeback by {'+'.join(by)} s"] = report.seconds
        with timed() as html:
            render_chargeback(built, "html")
        results["render chargeback HTML s"] = html.seconds
    finally:
        engine.dispose()
    return results


def server_version(url: str) -> str:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            if engine.dialect.name == "postgresql":
                return "PostgreSQL " + connection.execute(text("SHOW server_version")).scalar()
            return "SQLite " + connection.execute(text("SELECT sqlite_version()")).scalar()
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument(
        "--postgres",
        default=os.environ.get("ZQ_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
    )
    parser.add_argument("--records", type=int, default=20_000, help="records per ingest run")
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--big", type=int, default=1_000_000, help="rows for the report timings (0: skip)")
    args = parser.parse_args()
    configure_logging(level=logging.WARNING)
    print(
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    table: dict[str, dict[str, float]] = {}
    for backend in args.backends.split(","):
        with fresh_ledger(backend, args.postgres) as url:
            seed(url)
            version = server_version(url)
            table[version] = bench_ingest(url, args.records, args.batch)
            if args.big:
                table[version] |= bench_reports(url, args.big)
    print_table(table, args)


def print_table(table: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    backends = list(table)
    metrics = list(dict.fromkeys(metric for results in table.values() for metric in results))
    print(f"\n{args.records:,} records per ingest run, batches of {args.batch}; reports over {args.big:,} rows\n")
    print("| metric | " + " | ".join(backends) + " |")
    print("|---|" + "---:|" * len(backends))
    for metric in metrics:
        cells = [
            f"{table[b][metric]:,.0f}"
            if metric.endswith("/s")
            else f"{table[b][metric]:.2f}"
            if metric in table[b]
            else ""
            for b in backends
        ]
        print(f"| {metric} | " + " | ".join(cells) + " |")
    for backend, results in table.items():
        floor = results["bare INSERT records/s"]
        print(
            f"\n{backend}: direct ingest runs at {results['direct records/s'] / floor:.2f}× a bare INSERT; "
            f"replay (all duplicates) at {results['direct replay records/s'] / results['direct records/s']:.2f}× "
            "first delivery"
        )
        if "gRPC records/s" in results:
            print(
                f"{backend}: gRPC RecordUsage (batches of {args.batch}) runs at "
                f"{results['gRPC records/s'] / results['direct records/s']:.2f}× direct ingest; its replay at "
                f"{results['gRPC replay records/s'] / results['direct replay records/s']:.2f}× direct replay"
            )


if __name__ == "__main__":
    main()
