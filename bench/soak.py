"""Soak: one `zeroqueue serve` replica it starts (bundled model, serve defaults) at a steady share of capacity.

    .venv/bin/python bench/soak.py                        # 30 min at 80 % of the capacity it measures first
    .venv/bin/python bench/soak.py --minutes 2 --capacity-seconds 10 --knee-probes 3
    .venv/bin/python bench/soak.py --rate 40              # a known rate: no capacity measurement

Capacity is `zeroqueue pulse --capacity`'s knee (no confirmation runs) for pulse's fixed shape, 64 + 32 tokens in
2 s, which the soak sends as Poisson arrivals from several tenants, a share cancelled mid-stream, a share reusing
a request_id already used (same tenant or another), a trickle of bad input (tests/fuzz_generate.py, raw bytes).
Goals (exit 0 when all are met): server and engine RSS grow < 5 % after warm-up (the soak's first 10 %); at the
end every KV slot free, nothing in flight, the outbox empty; every call seen admitted has one ledger row (by
call_id) with its Final's usage and tenant, and no row of a soak tenant went unseen; bad input refused
precisely; health Check P99 < 50 ms with no failure; and two the soak can judge besides: no call of its (feasible)
shape called DEADLINE_INFEASIBLE, no ALREADY_EXISTS unless that tenant had the id running. One JSON summary
under --out, printed with the host CPU and the date.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from soak_book import Book  # noqa: E402
from soak_checks import (  # noqa: E402
    check_ledger,
    cpu_s,
    engine_children,
    host_info,
    make_tenants,  # noqa: E402
    outbox_counts,
    rss_kb,
    server_figures,
)
from soak_report import HEALTH_P99_GOAL_MS, print_summary, summarize  # noqa: E402
from zeroqueue.inference.v1 import inference_pb2 as pb  # noqa: E402

from services.client import AsyncClient, ZeroQueueError  # noqa: E402
from services.inference.bundled_model import default_model  # noqa: E402
from services.logs import configure_logging  # noqa: E402
from services.pulse.replicas import free_port, start_replica  # noqa: E402
from services.pulse.schedule import LoadSpec, arrival_times  # noqa: E402
from services.pulse.scrape import scrape  # noqa: E402
from tests.fuzz_generate import GENERATE, FuzzCall, GenerateFuzzer, Outcome, status_bytes  # noqa: E402

PROMPT_TOKENS, MAX_TOKENS, DEADLINE_MS = 64, 32, 2000  # pulse's fixed shape: the one its capacity is of
HEALTH_SERVICE = "zeroqueue.inference.v1.Inference"


def measure_capacity(replica, args: argparse.Namespace, work: Path) -> dict:
    """The pulse tool's own capacity search (closed-loop saturation, then the knee), against this replica, under
    the replica's first tenant, whose ledger rows the soak's checks leave out."""
    from services import cli

    out, seconds = work / "capacity", str(args.capacity_seconds)
    argv = [
        "pulse",
        "--capacity",
        "--endpoint",
        replica.address,
        "--metrics-url",
        replica.metrics_url,
        "--api-key",
        replica.api_key,
        "--duration",
        seconds,
        "--probe-duration",
        seconds,
        "--confirm-duration",
        "0",
        "--knee-probes",
        str(args.knee_probes),
        "--seed",
        str(args.seed),
        "--no-progress",
        "--no-plots",
        "--out",
        str(out),
    ]
    if cli.main(argv) != 0:
        raise SystemExit("soak: the capacity measurement failed")
    return json.loads((out / "capacity.json").read_text())


async def sdk_call(
    client: AsyncClient, tenant: int, kind: str, request_id: str, prompt: list[int], book: Book, rng: random.Random
) -> None:
    """One call through the SDK (so refusals are retried as a client would); a `cancel` call is closed by the
    client after a few chunks, mid-stream."""
    t0 = time.monotonic()
    generation = client.generate(
        prompt,
        DEADLINE_MS,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        request_id=request_id,
        labels={"team": f"team-{tenant}", "cost_center": "soak"},
    )
    cancel_after = rng.randint(1, 4) if kind == "cancel" else 0
    code, reason, chunks, key = "OK", "", 0, (tenant, request_id)
    if book.in_flight[key] > 0:
        # either call may reach the server first (the same channel does not order handlers): both are judged
        # as overlapping, not only the one that started second
        book.shared.add(key)
    book.in_flight[key] += 1
    try:
        async for _ in generation:
            chunks += 1
            if chunks == cancel_after:
                await generation.aclose()
                code = "CANCELLED_BY_CLIENT"
                break
    except ZeroQueueError as error:
        code, reason = error.code.name, error.reason
    except Exception as error:  # noqa: BLE001 - a soak records what the client hit and goes on
        code, reason = "CLIENT_ERROR", type(error).__name__
    # ids are the tenant's own: ALREADY_EXISTS is right only while another of this tenant's calls with the id runs
    book.wrong_in_use += code == "ALREADY_EXISTS" and key not in book.shared
    if not (left := book.in_flight[key] - 1):
        del book.in_flight[key]  # a 30-min run would otherwise keep every id it sent
        book.shared.discard(key)
    else:
        book.in_flight[key] = left
    result, admission = generation.result, generation.admission
    if admission is not None:
        book.admitted[admission.call_id] = (tenant, result.usage.device_us if result else None)
    if result is not None and kind == "normal":
        book.latency_ms.append((time.monotonic() - t0) * 1000)
    report = generation.report
    # 64 + 32 tokens in 2 s is feasible on this replica (capacity says so): an infeasible verdict is a misjudgement
    if report is not None and report.attempts and report.attempts[0].reason == "DEADLINE_INFEASIBLE":
        book.infeasible_first += 1
    book.count(kind, code, reason)


async def bad_call(channel: grpc.aio.Channel, call: FuzzCall, key: str, tenant: int, book: Book) -> None:
    """A mutated request sent as raw bytes (identity serializers), judged as bench/fuzz.py judges it; one that is
    admitted anyway (a mutation can stay valid) is booked like any admitted call."""
    stream = channel.unary_stream(GENERATE)(
        call.raw, timeout=5.0, metadata=(("authorization", f"Bearer {key}"), *call.metadata)
    )
    replies: list[pb.GenerateResponse] = []
    try:
        async for raw in stream:
            replies.append(pb.GenerateResponse.FromString(raw))
            if len(replies) == 1 and replies[0].WhichOneof("kind") == "admission":
                book.admitted[replies[0].admission.call_id] = (tenant, None)
        final = bool(replies) and replies[-1].WhichOneof("kind") == "final"
        outcome = Outcome(call.index, call.kind, "OK", num_replies=len(replies), final=final)
        if final and replies[0].WhichOneof("kind") == "admission":
            book.admitted[replies[0].admission.call_id] = (tenant, replies[-1].final.usage.sm_us)
    except grpc.aio.AioRpcError as error:
        size, reason = status_bytes(error.details(), error.trailing_metadata())
        outcome = Outcome(
            call.index, call.kind, error.code().name, reason, size, (error.details() or "")[:200], len(replies)
        )
    book.count("bad", outcome.code, outcome.reason)
    book.bad_log.append((round(time.monotonic() - book.t0, 1), call.kind, outcome.code))
    if outcome.failure is not None:
        book.num_imprecise += 1
        if len(book.imprecise) < 20:
            book.imprecise.append(
                {
                    "index": call.index,
                    "kind": call.kind,
                    "why": outcome.failure,
                    "code": outcome.code,
                    "message": outcome.message,
                }
            )


async def sample(server_pid: int, stop: asyncio.Event, book: Book, every_s: float, tick_s: float = 0.1) -> None:
    """RSS of the server and its engine every `every_s` (VmRSS); and, every tick, how late this loop woke."""
    t0, engine, next_rss = time.monotonic(), None, 0.0
    while not stop.is_set():
        if (now := time.monotonic() - t0) >= next_rss:
            if rss_kb(engine) is None:  # first pass, or the engine was replaced
                engine = next(iter(engine_children(server_pid)), None)
            book.rss.append((round(now, 1), rss_kb(server_pid), rss_kb(engine)))
            next_rss += every_s
        t1 = time.monotonic()
        await asyncio.sleep(tick_s)
        book.loop_lag_ms.append((time.monotonic() - t1 - tick_s) * 1000)


def health_probe(address: str, stop: threading.Event, book: Book, every_s: float = 0.1) -> None:
    """A Check every ~100 ms from a thread of its own (blocking stub, GIL released while it waits), so that the
    figure is the replica's answer and not how busy the generator's event loop is (loop_lag_ms says that)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=1.0)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    book.health_failures[health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)] += 1
            except grpc.RpcError as error:
                book.health_failures[error.code().name] += 1
            book.health_ms.append(ms := (time.monotonic() - t0) * 1000)
            if ms >= HEALTH_P99_GOAL_MS and len(book.health_slow) < 1000:
                book.health_slow.append((round(t0 - book.t0, 1), round(ms, 1)))
            stop.wait(every_s)


def pick_kind(rng: random.Random, args: argparse.Namespace, have_ids: bool) -> str:
    roll = rng.random()
    for kind, share in (("bad", args.bad_share), ("cancel", args.cancel_share), ("reuse", args.reuse_share)):
        if roll < share and (kind != "reuse" or have_ids):
            return kind
        roll -= share
    return "normal"


async def offer(args, qps: float, address: str, keys: list[str], model, book: Book) -> None:
    """Poisson arrivals (pulse's schedule), one task per call, sent at their time whatever the replica does."""
    rng = random.Random(args.seed)
    times = arrival_times(LoadSpec(qps, args.minutes * 60, "poisson", seed=args.seed), random.Random(args.seed))
    clients = [AsyncClient([address], key) for key in keys]
    channel = grpc.aio.insecure_channel(address)
    fuzzer = GenerateFuzzer(args.seed, model.name, model.context_length, model.vocab_size)
    weights = [len(keys) - i for i in range(len(keys))]  # tenants of unequal size
    tasks, fuzz_index, t0 = set(), 0, time.monotonic()
    for index, at_s in enumerate(times):
        if (delay := t0 + at_s - time.monotonic()) > 0:
            await asyncio.sleep(delay)
        book.max_lag_ms = max(book.max_lag_ms, (time.monotonic() - t0 - at_s) * 1000)
        tenant, kind = rng.choices(range(len(keys)), weights)[0], pick_kind(rng, args, bool(book.recent_ids))
        if kind == "bad":
            while (call := fuzzer.call(fuzz_index)).kind == "valid":  # the fuzzer's valid share is no bad input
                fuzz_index += 1
            coro, fuzz_index = bad_call(channel, call, keys[tenant], tenant, book), fuzz_index + 1
        else:
            request_id = f"soak-{args.seed}-{index}"
            if kind == "reuse":  # the same tenant's id (maybe still in flight) or another's
                ids = list(book.recent_ids)[-8:] if rng.random() < 0.5 else book.recent_ids  # recent: in flight
                owner, request_id = rng.choice(ids)
                tenant = owner if rng.random() < 0.5 else rng.randrange(len(keys))
            book.recent_ids.append((tenant, request_id))
            prompt = [rng.randrange(16, model.vocab_size) for _ in range(PROMPT_TOKENS)]
            coro = sdk_call(clients[tenant], tenant, kind, request_id, prompt, book, rng)
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks)
    for client in clients:
        await client.close()
    await channel.close()


async def soak(args, qps: float, replica, health_address: str, keys: list[str], model) -> Book:
    book, stop, probe_stop = Book(), asyncio.Event(), threading.Event()
    probe = threading.Thread(target=health_probe, args=(health_address, probe_stop, book), daemon=True)
    probe.start()
    pids = {"server": replica.proc.pid, "engine": next(iter(engine_children(replica.proc.pid)), None)}
    cpu0, own0, t0 = {k: cpu_s(pid) for k, pid in pids.items()}, time.process_time(), time.monotonic()
    sampler = asyncio.create_task(sample(replica.proc.pid, stop, book, args.sample_seconds))
    try:
        await offer(args, qps, replica.address, keys, model, book)
    finally:
        stop.set()
        probe_stop.set()
        await sampler
        probe.join(5)
    # cores each used: on 2 shared cores, what the generator takes the replica lacks
    elapsed, cpu1 = time.monotonic() - t0, {k: cpu_s(pid) for k, pid in pids.items()}
    book.cpu_cores = {
        "generator": round((time.process_time() - own0) / elapsed, 3),
        **{k: round((cpu1[k] - cpu0[k]) / elapsed, 3) for k in pids if cpu0[k] and cpu1[k]},
    }
    return book


async def model_info(address: str, key: str):
    async with AsyncClient([address], key) as client:
        return (await client.list_models(timeout_s=30))[0]


def settle(replica, data_dir: Path, max_batch: int, timeout_s: float = 60.0) -> dict:
    """After the last call ended: waits for every slot and KV block to be free, nothing in flight, the outbox
    drained."""
    t0, state = time.monotonic(), {}
    while time.monotonic() - t0 < timeout_s:
        samples = scrape(replica.metrics_url)
        state = {
            "kv_slots_free": samples.get(("zeroqueue_kv_slots_free", ())),
            "kv_blocks_used": samples.get(("zeroqueue_kv_blocks", (("state", "used"),))),
            "in_flight": samples.get(("zeroqueue_in_flight", ())),
            "max_batch": max_batch,
            "outbox": outbox_counts(data_dir),
        }
        idle = state["kv_slots_free"] == max_batch and state["kv_blocks_used"] == 0 and state["in_flight"] == 0
        if idle and state["outbox"]["pending"] == 0:
            break
        time.sleep(0.5)
    return {**state, "settled_after_s": round(time.monotonic() - t0, 2)}


def run(args: argparse.Namespace, host: dict, stamp: str) -> dict:
    work = Path(args.out) / f"run-{stamp}"
    health_port = free_port()
    serve_args = ["--health-port", str(health_port), *shlex.split(args.serve_args)]
    print(f"starting a replica on {args.model or default_model()} (warm-up and calibration first) ...", flush=True)
    replica = start_replica(Path(args.model) if args.model else default_model(), "deadline", work, serve_args)
    data_dir, stopped = replica.log_path.parent, {}
    url = f"sqlite:///{data_dir / 'ledger.db'}"  # the one start_replica made
    try:
        keys, tenant_ids = make_tenants(url, args.tenants, stamp)
        model = asyncio.run(model_info(replica.address, replica.api_key))
        capacity = None if args.rate else measure_capacity(replica, args, work)
        qps = args.rate or args.load * capacity["capacity_qps"]
        print(
            f"soak: {qps:.2f} req/s for {args.minutes:g} min, {args.tenants} tenants, on {replica.address}", flush=True
        )
        before = scrape(replica.metrics_url)
        book = asyncio.run(soak(args, qps, replica, f"127.0.0.1:{health_port}", keys, model))
        end = settle(replica, data_dir, model.max_batch)
        server = server_figures(before, scrape(replica.metrics_url))
    finally:
        replica.stop()  # SIGTERM: drains, flushes the outbox into the ledger
        stopped = {"returncode": replica.proc.returncode}
    stopped["outbox"] = outbox_counts(data_dir)
    ledger = check_ledger(url, book.admitted, tenant_ids)
    return summarize(args, host, qps, capacity, book, end, server, stopped, ledger)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--load", type=float, default=0.8, help="share of the measured capacity to offer")
    p.add_argument("--rate", type=float, default=None, help="req/s to offer; skips the capacity measurement")
    p.add_argument("--capacity-seconds", type=float, default=20.0, help="saturation run and each knee probe")
    p.add_argument("--knee-probes", type=int, default=6)
    p.add_argument("--tenants", type=int, default=3)
    p.add_argument("--cancel-share", type=float, default=0.05)
    p.add_argument("--bad-share", type=float, default=0.01)
    p.add_argument("--reuse-share", type=float, default=0.03)
    p.add_argument("--sample-seconds", type=float, default=5.0, help="RSS sampling period")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    p.add_argument("--serve-args", default="", help="extra `zeroqueue serve` arguments (default: none)")
    p.add_argument("--out", default="bench/out/soak")
    args = p.parse_args()
    if args.tenants < 1:
        p.error("--tenants: at least 1")
    host, stamp = host_info(), time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    print(f"host: {host}", flush=True)
    summary = run(args, host, stamp)
    path = Path(args.out) / f"soak-{stamp}.json"
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print_summary(summary, path)
    return 0 if summary["all_goals_met"] else 1


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    sys.exit(main())
