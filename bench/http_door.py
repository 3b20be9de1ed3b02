"""The HTTP door beside gRPC on one replica, in one run: server CPU per call, and refusal latency at the server.

Starts one `zeroqueue serve` (services/pulse/replicas.py: its own ledger, tenant and key) on the bundled model with
its HTTP door (`--http-port`), then, the doors alternating round by round:
1. CPU: a fixed workload per round (4 callers, 200 calls of a 44-token prompt, max_tokens 8, greedy) through gRPC
   (the SDK, services.client.Client) and HTTP /v1/completions (a plain keep-alive httpx client, not streamed); and
   the same prompt as a chat message through the SDK (`messages=`) and HTTP /v1/chat/completions streamed (SSE).
   Server CPU is utime+stime from /proc of the replica's process and its descendants (the engine process) around
   each round, per call; also the server process alone (the doors live there: the engine has a process of its own)
   and, beside them, the device time the replica billed (zeroqueue_device_unit_us_total: busy wall time × cores).
2. Refusals: 8 long calls (max_tokens 200, from a loader subprocess using the SDK, retrying at the hint) keep every
   slot full while one caller sends refusable calls (max_tokens 16, a 1-s budget) one at a time, ~10 ms apart,
   through one door per round. Server side: the bucket deltas of zeroqueue_refusal_reply_seconds (gRPC) and
   zeroqueue_http_refusal_reply_seconds (HTTP), per door from its own rounds (the gRPC one also counts the loaders'
   own refusals; the HTTP one only this caller's), P50/P99 interpolated within buckets as histogram_quantile does;
   client side: call start -> refusal received.
`--pin`: the replica (server, engine) on core 0, this process and the loaders on core 1. stdout: the tables; --out:
results.json; logs on stderr.

    .venv/bin/python bench/http_door.py [--pin] [--rounds 4] --out bench/results/http-door-2026-12-04/RUN
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from http_door_report import DOORS, REFUSAL_HISTOGRAM, histogram, print_tables, summarize_cpu, summarize_refusals  # noqa: E402
from soak_checks import cpu_s, host_info  # noqa: E402  (bench/soak_checks.py)

from services.client import Client, RetryConfig, ZeroQueueError  # noqa: E402
from services.inference.bundled_model import BUNDLED_MODEL  # noqa: E402
from services.inference.device.cpus import pin  # noqa: E402
from services.logs import configure_logging  # noqa: E402
from services.pulse.replicas import start_replica  # noqa: E402
from services.pulse.scrape import delta, scrape  # noqa: E402
from services.pulse.stats import percentile  # noqa: E402

PROMPT = '''def parse_args(argv):
    """Parse --name=value pairs from argv into a dict of strings."""
    result = {}
    for item in argv:
        if item.startswith("--"):
'''
CHAT = [{"role": "user", "content": PROMPT}]
BUDGET_MS = 30_000


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def descendants(pid: int) -> list[int]:
    """pid and every process below it (a child belongs to the thread that started it)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def tree_cpu(pid: int) -> tuple[float, float]:
    """(the whole tree's CPU seconds, the server process's own)."""
    return sum(cpu_s(p) or 0.0 for p in descendants(pid)), cpu_s(pid) or 0.0


def host_busy_s() -> float:
    """CPU seconds the whole host has spent busy (all cores; /proc/stat less idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """This process's CPU and its reaped children's (the replica and its engine, the loaders), seconds."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Doors:
    """One call through each door: the SDK over gRPC, plain httpx over HTTP/1.1 keep-alive."""

    def __init__(self, replica, model: str) -> None:
        self.key, self.model = replica.api_key, model
        self.sdk = Client([replica.address], replica.api_key, retry=RetryConfig(max_attempts=1))
        self.http = httpx.Client(
            base_url=replica.http_url, timeout=60, limits=httpx.Limits(max_connections=16, max_keepalive_connections=16)
        )

    def headers(self, budget_ms: int) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}", "x-budget-ms": str(budget_ms)}

    def call(self, door: str, max_tokens: int, budget_ms: int = BUDGET_MS) -> int:
        """One call; its completion tokens (0: refused). Anything but a 200 or a refusal raises."""
        if door.startswith("grpc"):
            ask = {"messages": CHAT} if door == "grpc-chat" else {"prompt": PROMPT}
            try:
                gen = self.sdk.generate(deadline_ms=budget_ms, max_tokens=max_tokens, temperature=0, **ask)
                return gen.collect().usage.completion_tokens
            except ZeroQueueError as error:
                if error.failure.code.name != "RESOURCE_EXHAUSTED":
                    raise
                return 0
        if door == "http":
            body = {"model": self.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
            reply = self.http.post("/v1/completions", json=body, headers=self.headers(budget_ms))
            if reply.status_code == 429:
                return 0
            reply.raise_for_status()
            return reply.json()["usage"]["completion_tokens"]
        body = {"model": self.model, "messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        chunks = 0
        with self.http.stream("POST", "/v1/chat/completions", json=body, headers=self.headers(budget_ms)) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                chunks += line.startswith("data: {")
        return chunks

    def close(self) -> None:
        self.sdk.close()
        self.http.close()


def device_us(samples) -> float:
    return sum(v for (name, _), v in samples.items() if name == "zeroqueue_device_unit_us_total")


def cpu_round(doors: Doors, replica, door: str, calls: int, callers: int) -> dict:
    """`calls` calls through `door` from `callers` threads; the replica's CPU around them, per call."""
    latencies: list[float] = []

    def caller(n: int) -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            if doors.call(door, 8) <= 0:
                raise RuntimeError(f"{door}: a call of the CPU workload was refused or empty")
            latencies.append(time.perf_counter() - t0)

    before = scrape(replica.metrics_url)
    cpu0, wall0 = tree_cpu(replica.proc.pid), time.perf_counter()
    with ThreadPoolExecutor(callers) as pool:
        list(pool.map(caller, [calls // callers] * callers))
    wall, cpu1 = time.perf_counter() - wall0, tree_cpu(replica.proc.pid)
    dev = device_us(delta(scrape(replica.metrics_url), before))
    n = len(latencies)
    tree_us, server_us = (cpu1[0] - cpu0[0]) * 1e6 / n, (cpu1[1] - cpu0[1]) * 1e6 / n
    return {
        "door": door,
        "calls": n,
        "wall_s": round(wall, 3),
        "tree_us_per_call": round(tree_us, 1),
        "server_us_per_call": round(server_us, 1),
        "engine_us_per_call": round(tree_us - server_us, 1),
        "device_us_per_call": round(dev / n, 1),
        "client_p50_ms": round(percentile(latencies, 50) * 1000, 2),
    }


def refusal_round(doors: Doors, replica, door: str, calls: int, gap_s: float) -> dict:
    """`calls` refusable calls through `door`, one at a time `gap_s` apart, on the full replica."""
    client_ms, admitted = [], 0
    before = scrape(replica.metrics_url)
    for _ in range(calls):
        t0 = time.perf_counter()
        if doors.call(door, 16, budget_ms=1000):
            admitted += 1
        else:
            client_ms.append((time.perf_counter() - t0) * 1000)
        time.sleep(gap_s)
    d = delta(scrape(replica.metrics_url), before)
    return {"door": door, "refused": len(client_ms), "admitted": admitted, "client_ms": client_ms, "server": d}


def start_loaders(replica, n: int) -> subprocess.Popen:
    env = dict(os.environ, ZQ_BENCH_KEY=replica.api_key)
    cmd = [sys.executable, __file__, "--loaders-for", replica.address, "--slots", str(n)]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def loader_main(address: str, n: int) -> int:
    """The loader subprocess: n threads of back-to-back 200-token calls (the SDK retries refusals at the hint)
    until stdin closes; then its counts on stdout."""
    client, lock = Client([address], os.environ["ZQ_BENCH_KEY"]), threading.Lock()
    counts = {"calls": 0, "rejections": 0}

    def loop() -> None:
        while True:
            gen = client.generate("def main():", BUDGET_MS, max_tokens=200, temperature=0.8)
            try:
                gen.collect()
                key = "calls"
            except ZeroQueueError as error:
                key = f"error {error.code.name}/{error.reason}"
                time.sleep(0.01)
            with lock:
                counts[key] = counts.get(key, 0) + 1
                counts["rejections"] += gen.report.num_rejections if gen.report else 0

    for _ in range(n):
        threading.Thread(target=loop, daemon=True).start()
    sys.stdin.read()
    with lock:
        print(json.dumps(counts), flush=True)
    os._exit(0)


def phase_cpu(doors: Doors, replica, args) -> list[dict]:
    for door in DOORS:  # warm-up, not counted: first connections, the chat template's first render
        cpu_round(doors, replica, door, 40, args.callers)
    idle0 = tree_cpu(replica.proc.pid)
    time.sleep(5.0)  # the idle replica's own CPU (watchdog probes, policy reads), µs per second
    idle = [(b - a) / 5.0 * 1e6 for a, b in zip(idle0, tree_cpu(replica.proc.pid), strict=True)]
    rounds = []
    for r in range(args.rounds):
        for door in DOORS:
            rounds.append(cpu_round(doors, replica, door, args.calls, args.callers) | {"round": r + 1})
            log(json.dumps(rounds[-1]))
    rounds.append({"idle_us_per_s": {"tree": round(idle[0]), "server": round(idle[1])}})
    return rounds


def phase_refusals(doors: Doors, replica, args) -> tuple[list[dict], dict]:
    loaders = start_loaders(replica, args.slots)
    try:
        time.sleep(4.0)  # every slot fills
        rounds = []
        for r in range(args.rounds):
            for door in ("grpc", "http"):
                rounds.append(refusal_round(doors, replica, door, args.refusals, args.gap_ms / 1000) | {"round": r + 1})
                last = rounds[-1]
                log(f"refusals round {r + 1} {door}: refused {last['refused']} admitted {last['admitted']}")
    finally:
        out, _ = loaders.communicate("", timeout=60)
    return rounds, json.loads(out or "{}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per door, alternating")
    parser.add_argument("--calls", type=int, default=200, help="calls per CPU round")
    parser.add_argument("--callers", type=int, default=4)
    parser.add_argument("--slots", type=int, default=8, help="the replica's KV slots (--max-batch), all kept full")
    parser.add_argument("--refusals", type=int, default=300, help="refusable calls per refusal round")
    parser.add_argument("--gap-ms", type=float, default=10.0, help="pause between refusable calls")
    parser.add_argument("--pin", action="store_true", help="replica on core 0, this process and the loaders on 1")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--loaders-for", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loaders_for:
        return loader_main(args.loaders_for, args.slots)
    host, busy0, wall0 = host_info(), host_busy_s(), time.monotonic()
    if args.pin:
        pin([0])  # the replica inherits core 0 ...
    serve_args = ["--max-batch", str(args.slots), "--no-json-logs"]
    replica = start_replica(
        BUNDLED_MODEL, "deadline", Path(tempfile.mkdtemp(prefix="zq-http-door-")), serve_args, http=True
    )
    if args.pin:
        pin([1])  # ... and this process, its threads and the loaders take core 1
    for pid in descendants(replica.proc.pid):
        log(f"replica process {pid}: cores {os.sched_getaffinity(pid)}; log {replica.log_path}")
    models = httpx.get(replica.http_url + "/v1/models", headers={"authorization": f"Bearer {replica.api_key}"})
    doors = Doors(replica, models.json()["data"][0]["id"])
    try:
        cpu_rounds = phase_cpu(doors, replica, args)
        refusal_rounds, loaders = phase_refusals(doors, replica, args)
    finally:
        doors.close()
        replica.stop()
    cpu, refusals = summarize_cpu([r for r in cpu_rounds if "door" in r]), summarize_refusals(refusal_rounds)
    others = (host_busy_s() - busy0 - own_cpu_s()) / (time.monotonic() - wall0)
    print_tables(cpu, refusals)
    print(f"\nother processes on the host during the run: {others:.2f} cores on average (load {os.getloadavg()})")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for r in refusal_rounds:
            r["server"] = {REFUSAL_HISTOGRAM[r["door"]]: histogram(r["server"], REFUSAL_HISTOGRAM[r["door"]])}
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        run = {"git_head": head, "args": {k: str(v) for k, v in vars(args).items() if k != "loaders_for"}}
        run |= {"loadavg_end": os.getloadavg(), "other_processes_cores": round(others, 3), "loaders": loaders}
        result = {"host": host, **run, "cpu": cpu, "cpu_rounds": cpu_rounds}
        result |= {"refusals": refusals, "refusal_rounds": refusal_rounds}
        (args.out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    sys.exit(main())
