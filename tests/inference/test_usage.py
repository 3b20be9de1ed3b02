"""Usage end to end: from the engine's steps through the outbox to the ledger, exactly once."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import MappingProxyType

import grpc
import pytest
from sqlalchemy import create_engine, text
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc

from billing import commands
from billing.records import Door
from services.client.auth import authorized_channel
from services.inference.call import BudgetSource, GenerateSpec
from services.inference.device.executor import ExecutorConfig
from services.inference.sched.request import SamplingParams
from services.inference.serve_config import ServeConfig
from tests.inference.harness import ServerThread
from tests.inference.test_overload import fill, start_slow_server, wait_until
from tests.metering.harness import MeteringThread

ROOT = Path(__file__).resolve().parents[2]


def ledger_rows(url: str, sql: str):
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(sql)).fetchall()
    finally:
        engine.dispose()


def finals(stub, n, **fields):
    fields.setdefault("prompt", "def f(x):")
    fields.setdefault("max_tokens", 6)
    out = []
    for _ in range(n):
        messages = list(stub.Generate(pb.GenerateRequest(**fields), timeout=20))
        out.append((messages[0].admission.call_id, messages[-1].final))  # the ledger's call_id
    return out


def outbox_pending(data_dir: Path) -> int:
    with sqlite3.connect(data_dir / "outbox.db") as conn:
        return conn.execute(
            "SELECT COUNT(*) FROM outbox WHERE delivered_at_us IS NULL AND dead_at_us IS NULL"
        ).fetchone()[0]


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_served_run_bills_every_call_once_and_conserves_wall_time(llama_dir, tmp_path, engine_process):
    server = start_slow_server(llama_dir, engine_process=engine_process)
    stub = server.stub()
    done = finals(stub, 3, labels={"cost_center": "cc-7", "team": "search"})
    running = fill(server, max_tokens=60)
    with pytest.raises(grpc.RpcError) as info:  # refused at admission (no slot frees inside 0.5 s): never billed
        list(stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=5, request_id="refused-1"), timeout=0.5))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in running:
        call.join()
    cancelled = stub.Generate(
        pb.GenerateRequest(prompt="y", max_tokens=100, request_id="cancel-1", temperature=0.0), timeout=20
    )
    next(cancelled)
    next(cancelled)
    cancelled.cancel()
    wait_until(lambda: not server.replica.service.in_flight)
    time.sleep(0.2)
    server.stop()
    url = server.config.ledger_url
    records = ledger_rows(url, "SELECT * FROM usage_records")
    rows = {r.call_id: r for r in records} | {r.request_id: r for r in records if r.request_id}
    for call_id, final in done:
        assert rows[call_id].unit_us == final.usage.sm_us > 0
        assert rows[call_id].cost_center == "cc-7" and rows[call_id].team == "search"
        assert final.usage.unit == "core_us" and rows[call_id].unit == "core_us"
        assert rows[call_id].service_class == "standard"  # none named, none but standard offered
    assert "refused-1" not in rows
    assert rows["cancel-1"].outcome == "cancelled" and rows["cancel-1"].unit_us > 0
    assert len(records) == len(done) + len(running) + 1
    (billed,) = ledger_rows(url, "SELECT SUM(unit_us) FROM usage_records")[0]
    idle, wall = ledger_rows(url, "SELECT SUM(idle_unit_us), SUM(wall_unit_us) FROM idle_records")[0]
    assert billed + idle == wall  # Σ billed + idle = wall time × cores


def test_each_call_is_billed_once_with_the_door_it_came_through(llama_dir):
    """The service bills the door its call's spec names and nothing else: a call over gRPC says grpc; one admitted
    with a spec that says http (as the HTTP door builds it) says http. One row each, the same device time rules."""
    server = start_slow_server(llama_dir)
    try:
        ((grpc_call, _),) = finals(server.stub(), 1, request_id="over-grpc")
        service = server.replica.service
        spec = GenerateSpec("over-http", (1, 2, 3), SamplingParams(max_tokens=3), MappingProxyType({}), door=Door.HTTP)

        async def through_http() -> str:
            ticket = service.submit(spec, "acme", time.monotonic_ns(), 10**10, BudgetSource.CLIENT_DEADLINE)
            try:
                async for _ in service.stream(ticket):  # its usage is on disk once the last output is
                    pass
            finally:
                service.close(ticket)
            return ticket.call_id

        http_call = server.run(through_http())
    finally:
        server.stop()  # the outbox drains into the ledger
    rows = ledger_rows(server.config.ledger_url, "SELECT call_id, request_id, door, unit_us FROM usage_records")
    assert sorted((call_id, request_id, door) for call_id, request_id, door, _ in rows) == sorted(
        [(grpc_call, "over-grpc", "grpc"), (http_call, "over-http", "http")]
    )
    assert all(unit_us > 0 for *_, unit_us in rows)
    weight_dtypes = ledger_rows(server.config.ledger_url, "SELECT DISTINCT weight_dtype FROM usage_records")
    assert weight_dtypes == [(service.card.dtype,)]  # unquantized: the checkpoint's dtype, whichever the door


def test_a_replica_serving_int8_weights_bills_every_call_as_int8(llama_dir):
    """Issue 34: with --quantize int8 each usage record says int8, from the meter through the outbox to the ledger,
    beside the device time the call measured."""
    executor = ExecutorConfig(max_batch=2, max_seq_len=256, quantize="int8")
    server = ServerThread(ServeConfig(str(llama_dir), port=0, executor=executor, engine_process=False)).start()
    try:
        assert server.replica.service.card.weight_dtype == "int8"
        done = finals(server.stub(), 2, request_id="on-int8")
    finally:
        server.stop()  # the outbox drains into the ledger
    rows = ledger_rows(server.config.ledger_url, "SELECT call_id, request_id, weight_dtype, unit_us FROM usage_records")
    assert sorted(rows) == sorted((call_id, "on-int8", "int8", final.usage.sm_us) for call_id, final in done)
    assert all(unit_us > 0 for *_, unit_us in rows)


def test_usage_survives_a_metering_outage(llama_dir, tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    commands.migrate(url)
    tenant_key, admin_key = commands.create_tenant(url, "acme"), commands.create_admin_key(url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metering = MeteringThread(url, port=port).start()
    config = ServeConfig(
        str(llama_dir),
        port=0,
        data_dir=str(tmp_path / "replica"),
        metering_address=metering.address,
        metering_key=admin_key,
        executor=ExecutorConfig(max_batch=4, max_seq_len=256),
    )
    server = ServerThread(config).start()
    try:
        stub = server.stub(key=tenant_key)
        before = finals(stub, 3)
        metering.stop()
        during = finals(stub, 6)  # the key is cached; the usage waits
        wait_until(lambda: outbox_pending(tmp_path / "replica") >= len(during), timeout=10)
        metering = MeteringThread(url, port=port).start()
        wait_until(lambda: outbox_pending(tmp_path / "replica") == 0, timeout=30)
    finally:
        server.stop()
        metering.stop()
    rows = ledger_rows(url, "SELECT call_id, unit_us FROM usage_records")
    assert sorted(rows) == sorted((rid, f.usage.sm_us) for rid, f in before + during)


def _serve(model: Path, data_dir: Path, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        "--ledger",
        f"sqlite:///{data_dir / 'ledger.db'}",
        "--max-batch",
        "4",
        "--max-seq-len",
        "256",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if "SERVING" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc
    raise RuntimeError("server exited before SERVING")


@pytest.mark.slow
def engine_children(pid: int) -> list[int]:
    """The engine processes a replica spawned (multiprocessing's resource tracker is its other child)."""
    # a child belongs to the thread that started it (warm-up runs on a worker thread): look at every thread
    children = [c for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_sigkill_loses_no_usage_of_a_finished_call(llama_dir, tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    commands.migrate(url)
    key = commands.create_tenant(url, "acme")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _serve(llama_dir, tmp_path, port)
    finished, stop = [], threading.Event()

    def client():
        stub = inference_pb2_grpc.InferenceStub(authorized_channel(f"127.0.0.1:{port}", key))
        while not stop.is_set():
            try:
                messages = list(stub.Generate(pb.GenerateRequest(prompt="def g():", max_tokens=12), timeout=10))
                finished.append((messages[0].admission.call_id, messages[-1].final.usage.sm_us))
            except grpc.RpcError:
                pass

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(finished) >= 20, timeout=60)
        engines = engine_children(proc.pid)
        assert len(engines) == 1
    except BaseException:
        proc.kill()
        raise
    os.kill(proc.pid, signal.SIGKILL)  # no drain, no flush, no goodbye
    proc.wait(10)
    wait_until(lambda: not running(engines[0]), timeout=15)  # its engine process does not linger
    stop.set()
    for t in threads:
        t.join(15)
    proc = _serve(llama_dir, tmp_path, port)
    try:
        wait_until(lambda: outbox_pending(tmp_path) == 0, timeout=30)
    finally:
        proc.terminate()
        proc.wait(30)
    rows = ledger_rows(url, "SELECT call_id, COUNT(*), SUM(unit_us) FROM usage_records GROUP BY call_id")
    stored = {call_id: (count, unit_us) for call_id, count, unit_us in rows}
    for call_id, sm_us in finished:
        assert stored[call_id] == (1, sm_us), call_id
