"""Fuzzes one in-process replica with N generated Generate calls (tests/fuzz_generate.py) and tallies the answers.

Prints the count per status code and ErrorInfo reason, the largest status seen (it must stay under gRPC's 8 KiB
soft metadata limit), health-check answers, and every call that is a server bug (INTERNAL or UNKNOWN for what a
client sent, a status too large, a RESOURCE_EXHAUSTED that is no overload, a stream without its Final), with its
index: `GenerateFuzzer(seed, ...).call(index)` makes that call again alone. Exits 1 if there was any.

    python bench/fuzz.py [--calls 100000] [--seed 1] [--model DIR] [--concurrency 24]

Without --model it serves the bundled model when it is there, else builds the tests' tiny random checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from services.inference.bundled_model import BUNDLED_MODEL  # noqa: E402
from services.inference.device.executor import ExecutorConfig  # noqa: E402
from services.inference.serve_config import ServeConfig  # noqa: E402
from services.logs import configure_logging  # noqa: E402
from tests.fuzz_generate import GenerateFuzzer, Tally, send  # noqa: E402
from tests.inference.harness import ServerThread  # noqa: E402


def model_dir(given: str | None) -> str:
    if given:
        return given
    if (BUNDLED_MODEL / "config.json").exists():
        return str(BUNDLED_MODEL)
    from tests.checkpoints import save_hf_checkpoint

    return str(save_hf_checkpoint(Path(tempfile.mkdtemp(prefix="zq-fuzz-")), "llama", initializer_range=0.1))


async def health(address: str, stop: asyncio.Event, stats: dict) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(service="zeroqueue.inference.v1.Inference"), timeout=5
                )
                ok = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                ok = False
            stats["answers" if ok else "failures"] += 1
            stats["max_s"] = max(stats["max_s"], time.monotonic() - t0)
            await asyncio.sleep(0.2)


async def fuzz(server: ServerThread, args: argparse.Namespace) -> tuple[Tally, dict]:
    card = server.replica.service.card
    fuzzer = GenerateFuzzer(args.seed, card.name, card.context_length, card.vocab_size, args.max_request_bytes)
    tally, stats, stop = Tally(keep=args.keep), {"answers": 0, "failures": 0, "max_s": 0.0}, asyncio.Event()
    checker = asyncio.create_task(health(server.address, stop, stats))
    metadata = (("authorization", f"Bearer {server.key}"),)
    calls, t0 = iter(fuzzer.calls(args.calls)), time.monotonic()
    async with grpc.aio.insecure_channel(
        server.address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:

        async def worker() -> None:
            for call in calls:
                tally.add(await send(channel, call, metadata, timeout=args.timeout))
                if tally.total % args.progress == 0:
                    rate = tally.total / (time.monotonic() - t0)
                    print(f"{tally.total} calls, {rate:.0f}/s, {tally.num_failures} failures", flush=True)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    stop.set()
    await checker
    return tally, stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model", help="checkpoint directory (default: bundled, else a tiny random one)")
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--timeout", type=float, default=5.0, help="each call's deadline, s")
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--max-request-bytes", type=int, default=256 << 10, help="largest generated request")
    parser.add_argument("--progress", type=int, default=10_000, help="print a line every this many calls")
    parser.add_argument("--keep", type=int, default=50, help="failures listed in full")
    args = parser.parse_args()
    # one refusal line per call would drown the tally (and slow the replica): warnings and errors only
    configure_logging(level=logging.WARNING)
    config = ServeConfig(
        model_dir(args.model), port=0, executor=ExecutorConfig(max_batch=args.max_batch, max_seq_len=args.max_seq_len)
    )
    server = ServerThread(config).start()
    t0 = time.monotonic()
    try:
        tally, stats = asyncio.run(fuzz(server, args))
    finally:
        server.stop()
    print(f"seed {args.seed}, {time.monotonic() - t0:.1f} s")
    print(tally.report())
    print(f"health: {stats['answers']} answers, {stats['failures']} failures, slowest {stats['max_s'] * 1000:.0f} ms")
    return 1 if tally.num_failures or stats["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
