"""What a refusal costs the replica (issue 35): server CPU per refusal, and how fast a burst into a full replica is
refused, by the server's own stamps.

Starts one `zeroqueue serve` (services/pulse/replicas.py) on the bundled model with `--slots` KV slots (1), kept full
by loader threads (one per slot, each a back-to-back `--loader-tokens` call: few token messages to relay, so the
server's own work is mostly the refusals measured).
Then, round by round:
1. lone refusals: `--refusals` refusable gRPC calls (max_tokens 16, a 200-ms budget) one at a time, `--gap-ms`
   apart, through a bare stub. Server CPU per refusal is the server process's CPU (utime+stime from /proc; the
   engine has its own process) over the round, less its CPU over a quiet interval of the same length with only
   the loaders running, divided by the refusals; and the refusal's reply time as the server stamps it
   (zeroqueue_refusal_reply_seconds: the whole message received -> the status sent).
2. bursts: `--burst` calls (1-s budgets) at once from one channel; the burst's span at the server is its last refusal's
   x-server-time (epoch µs, stamped as the status is built) less the moment the client started sending (the same
   host, the same clock), and the CPU the server spent over the burst, per refusal.
`--floor`: the same rounds against a bare grpc.aio server (this file's `floor_server`) whose Generate refuses at
once with a prebuilt status of the same shape: what gRPC's own Python server costs a refused streaming call,
below which no change to zeroqueue's code can go. `--pin`: the replica on core 0, this process and the loaders on
core 1. stdout: the summary as JSON; --out: results.json; logs on stderr.

    .venv/bin/python bench/refusal_cost.py [--pin] [--rounds 3] [--out bench/results/refusal-cost-DATE/RUN]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from http_door_report import histogram  # noqa: E402
from soak_checks import cpu_s, host_info  # noqa: E402  (bench/soak_checks.py)
from zeroqueue.inference.v1 import inference_pb2 as pb  # noqa: E402
from zeroqueue.inference.v1 import inference_pb2_grpc  # noqa: E402

from services.inference.bundled_model import BUNDLED_MODEL  # noqa: E402
from services.inference.device.cpus import pin  # noqa: E402
from services.pulse.replicas import start_replica  # noqa: E402
from services.pulse.scrape import delta, scrape  # noqa: E402
from services.pulse.stats import percentile  # noqa: E402

HISTOGRAM = "zeroqueue_refusal_reply_seconds"
LONE_BUDGET_S = 0.2  # a lone refusable call's budget: short, so a slot freeing now and then rarely admits one
BURST_BUDGET_S = 1.0  # a burst call's: long enough that the client's own sending of the burst leaves it time
PROMPT = "def parse_args(argv):\n    result = {}\n"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def request(n: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=PROMPT, max_tokens=16, temperature=0.0, request_id=f"refusal-{n}")


def server_time_us(error: grpc.RpcError) -> int | None:
    for key, value in error.trailing_metadata() or ():
        if key == "x-server-time":
            return int(value)
    return None


async def lone(stub, metadata, n: int, gap_s: float, first: int) -> tuple[int, int, list[float]]:
    """`n` refusable calls one at a time; (refused, admitted, client ms of each refusal)."""
    refused, admitted, client_ms = 0, 0, []
    for i in range(n):
        t0 = time.perf_counter()
        try:
            async for _ in stub.Generate(request(first + i), timeout=LONE_BUDGET_S, metadata=metadata):
                pass
            admitted += 1
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                admitted += 1  # admitted, then cut short by its own deadline
            else:
                refused += 1
                client_ms.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(gap_s)
    return refused, admitted, client_ms


async def burst(stub, metadata, n: int, first: int) -> tuple[int, int, int]:
    """`n` calls at once; (refused, the span from the first send to the last refusal's server stamp in µs,
    the span to the last refusal received at the client in µs)."""

    async def one(i: int) -> int | None:
        try:
            async for _ in stub.Generate(request(first + i), timeout=BURST_BUDGET_S, metadata=metadata):
                pass
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return server_time_us(error)
        return None

    sent_us = time.time_ns() // 1000
    stamps = [s for s in await asyncio.gather(*(one(i) for i in range(n))) if s is not None]
    received_us = time.time_ns() // 1000
    return len(stamps), (max(stamps) - sent_us) if stamps else 0, received_us - sent_us


async def rounds(replica, args) -> list[dict]:
    metadata = (("authorization", f"Bearer {replica.api_key}"),)
    pid, out, first = replica.proc.pid, [], 0
    async with grpc.aio.insecure_channel(replica.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await lone(stub, metadata, 20, 0.01, 10**6)  # warm: the channel, the key's cache
        for r in range(args.rounds):
            cpu0, t0 = cpu_s(pid), time.perf_counter()
            await asyncio.sleep(args.refusals * args.gap_ms / 1000)  # quiet: only the loaders
            quiet_s, quiet_cpu = time.perf_counter() - t0, cpu_s(pid) - cpu0
            before = scrape(replica.metrics_url) if replica.metrics_url else {}
            cpu0, t0 = cpu_s(pid), time.perf_counter()
            refused, admitted, client_ms = await lone(stub, metadata, args.refusals, args.gap_ms / 1000, first)
            wall_s, cpu = time.perf_counter() - t0, cpu_s(pid) - cpu0
            first += args.refusals
            reply = histogram(delta(scrape(replica.metrics_url), before), HISTOGRAM) if replica.metrics_url else None
            extra_s = cpu - quiet_cpu * wall_s / quiet_s
            row = {"round": r + 1, "kind": "lone", "refused": refused, "admitted": admitted}
            row |= {"server_cpu_ms_per_refusal": round(extra_s * 1000 / max(refused, 1), 3)}
            row |= {
                "client_p50_ms": round(percentile(client_ms, 50), 3),
                "client_p99_ms": round(percentile(client_ms, 99), 3),
            }
            row |= {"server_reply": reply}
            out.append(row)
            log(json.dumps({k: v for k, v in row.items() if k != "server_reply"}))
            for _ in range(args.bursts):
                await asyncio.sleep(0.5)
                cpu0 = cpu_s(pid)
                refused, span_us, client_us = await burst(stub, metadata, args.burst, first)
                await asyncio.sleep(0.05)  # the server's last logging and metrics of the burst
                cpu = cpu_s(pid) - cpu0 - quiet_cpu / quiet_s * (client_us / 1e6 + 0.05)
                first += args.burst
                row = {"round": r + 1, "kind": "burst", "n": args.burst, "refused": refused}
                row |= {"server_span_ms": round(span_us / 1000, 2), "client_span_ms": round(client_us / 1000, 2)}
                row |= {"server_cpu_ms_per_refusal": round(cpu * 1000 / max(refused, 1), 3)}
                out.append(row)
                log(json.dumps(row))
    return out


def floor_server(port: int) -> None:
    """A bare grpc.aio server for `--floor`: Generate refuses at once with a status as large as a real refusal."""
    from google.protobuf import any_pb2
    from google.rpc import code_pb2, error_details_pb2, status_pb2
    from grpc_status import rpc_status

    info = error_details_pb2.ErrorInfo(reason="OVERLOADED", domain="zeroqueue.dev", metadata={"retry_after_ms": "50"})
    retry = error_details_pb2.RetryInfo()
    retry.retry_delay.FromMilliseconds(50)
    details = [any_pb2.Any(), any_pb2.Any()]
    details[0].Pack(info)
    details[1].Pack(retry)
    proto = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message="slots full", details=details)
    status = rpc_status.to_status(proto)

    class Floor(inference_pb2_grpc.InferenceServicer):
        async def Generate(self, request, context):  # noqa: N802 - the gRPC method's name
            stamp = ("x-server-time", str(time.time_ns() // 1000))
            await context.abort_with_status(status._replace(trailing_metadata=(*status.trailing_metadata, stamp)))
            yield pb.GenerateResponse()  # never reached: it makes this a server-streaming handler

    async def serve() -> None:
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(Floor(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("serving", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


class FloorReplica:
    """`--floor`'s server as rounds() sees a replica: an address, a key, a pid, no metrics."""

    def __init__(self) -> None:
        from services.pulse.replicas import free_port

        port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--floor-server", str(port)], stdout=subprocess.PIPE, text=True
        )
        self.proc.stdout.readline()
        self.address, self.api_key, self.metrics_url = f"127.0.0.1:{port}", "floor", None

    def stop(self) -> None:
        self.proc.kill()


class Loaders:
    """One thread per slot, each sending `tokens`-token calls back to back until stopped (a refusal: at its hint)."""

    def __init__(self, replica, n: int, tokens: int) -> None:
        import threading

        self.stopped, self.calls = threading.Event(), 0
        channel = grpc.insecure_channel(replica.address)
        stub, metadata = inference_pb2_grpc.InferenceStub(channel), (("authorization", f"Bearer {replica.api_key}"),)
        ask = pb.GenerateRequest(prompt="def main():", max_tokens=tokens, temperature=0.8)

        def loop() -> None:
            while not self.stopped.is_set():
                try:
                    for _ in stub.Generate(ask, timeout=60, metadata=metadata):
                        pass
                    self.calls += 1
                except grpc.RpcError:
                    time.sleep(0.01)

        self.threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stopped.set()


def summary(rows: list[dict]) -> dict:
    lone_rows = [r for r in rows if r["kind"] == "lone"]
    bursts = [r for r in rows if r["kind"] == "burst"]
    med = lambda xs: round(percentile(sorted(xs), 50), 3) if xs else None  # noqa: E731
    return {
        "lone_cpu_ms_per_refusal_median": med([r["server_cpu_ms_per_refusal"] for r in lone_rows]),
        "lone_client_p50_ms_median": med([r["client_p50_ms"] for r in lone_rows]),
        "burst_server_span_ms_median": med([r["server_span_ms"] for r in bursts]),
        "burst_server_span_ms_max": max((r["server_span_ms"] for r in bursts), default=None),
        "burst_client_span_ms_median": med([r["client_span_ms"] for r in bursts]),
        "burst_cpu_ms_per_refusal_median": med([r["server_cpu_ms_per_refusal"] for r in bursts]),
        "burst_refused_min": min((r["refused"] for r in bursts), default=None),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=1, help="the replica's KV slots (--max-batch), all kept full")
    parser.add_argument("--loader-tokens", type=int, default=400, help="tokens of each call that keeps a slot full")
    parser.add_argument("--refusals", type=int, default=300, help="lone refusals per round")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="pause between lone refusals")
    parser.add_argument("--burst", type=int, default=128, help="calls per burst")
    parser.add_argument("--bursts", type=int, default=3, help="bursts per round")
    parser.add_argument("--pin", action="store_true", help="replica on core 0, this process and the loaders on 1")
    parser.add_argument("--floor", action="store_true", help="a bare grpc.aio server instead of a replica")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--floor-server", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_server:
        floor_server(args.floor_server)
        return 0
    host = host_info()
    if args.pin:
        pin([0])
    if args.floor:
        replica, loaders = FloorReplica(), None
    else:
        serve_args = ["--max-batch", str(args.slots), "--no-json-logs"]
        replica = start_replica(BUNDLED_MODEL, "deadline", Path(tempfile.mkdtemp(prefix="zq-refusal-")), serve_args)
    if args.pin:
        pin([1])
    try:
        if not args.floor:
            loaders = Loaders(replica, args.slots, args.loader_tokens)
            time.sleep(4.0)  # every slot fills
            log(f"slots full; replica process {replica.proc.pid}")
        rows = asyncio.run(rounds(replica, args))
    finally:
        if loaders is not None:
            loaders.stop()
        replica.stop()
    result = summary(rows)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        run = {"git_head": head, "host": host, "args": vars(args) | {"out": str(args.out)}, "loadavg": os.getloadavg()}
        (args.out / "results.json").write_text(json.dumps(run | {"summary": result, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
