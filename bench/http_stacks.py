"""HTTP stacks for the replica's HTTP door (issue 32): which server, and which body-schema library.

Every stack runs in its own process (bench/http_stack_apps.py) whose one asyncio loop also runs a `grpc.aio`
server with the health service, pinned to CPU 0; wrk (and this script) run on CPU 1. Per stack, in each of the
rounds (stacks in a different order each round):

  - saturation: wrk closed loop, 1 thread, 16 connections: requests/s and the server's CPU µs per request
    (utime + stime from /proc/PID/stat, before and after), with a gRPC health check every 0.2 s meanwhile;
  - fixed rate: the same 16 connections, each waiting an exponential delay (mean 16 / rate s) between its
    requests: achieved rate, p50 / p99 latency (wrk's), and the server's CPU µs per request.

Other work on these cores (other sessions share the host) takes the server's core: before each stack the bench
waits up to --quiet-wait s for a quiet second, records each core's busy share in every phase, and reports req/s per
core as 1e6 / CPU µs per request beside the measured req/s (the two agree when the server had its core).

Before that, in this process on CPU 0: µs per parse + validate of the same ~1.1 KiB chat body with pydantic v2,
msgspec and plain json.loads (the floor), batches interleaved, median of the batches.

    python bench/http_stacks.py --out bench/results/http-stacks-2026-12-04 [--quick]

stdout: the tables (markdown); --out also gets results.json and table.md. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import grpc
import msgspec
from grpc_health.v1 import health_pb2, health_pb2_grpc
from http_stack_apps import (  # bench/http_stack_apps.py
    HOST,
    MSGSPEC_DECODER,
    NO_SCHEMA,
    PATH,
    STACKS,
    ChatRequest,
    invalid_body,
    sample_body,
)

HERE = Path(__file__).resolve().parent
SERVER_CPU, LOAD_CPU = 0, 1
PLAN = "uvicorn-httptools-starlette"
CONNECTIONS = 16
QUIET_BUSY = 0.15  # cores busy, both together, that count as a quiet host
PACKAGES = (
    "uvicorn httptools h11 starlette hypercorn aiohttp pydantic pydantic-core msgspec grpcio grpcio-health-checking"
)

WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[%(body)s]==]
local mean_ms = %(mean_ms)s
if mean_ms > 0 then
  math.randomseed(os.time())
  function delay() return math.floor(-math.log(1 - math.random()) * mean_ms + 0.5) end
end
function done(s, lat, req)
  local e = s.errors
  io.write(string.format('RESULT {"requests": %%d, "duration_us": %%d, "socket_errors": %%d, "status_errors": %%d, '
    .. '"p50_us": %%d, "p90_us": %%d, "p99_us": %%d, "max_us": %%d, "mean_us": %%.1f}\\n',
    s.requests, s.duration, e.connect + e.read + e.write + e.timeout, e.status,
    lat:percentile(50), lat:percentile(90), lat:percentile(99), lat.max, lat.mean))
end
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- schema libraries ---


def schema_bench(reps: int, batch: int) -> dict:
    """µs per call of each parser on the same body; batches of the cases interleaved, rotating the order."""
    body = sample_body()
    pyd = ChatRequest.model_validate_json(body).model_dump(by_alias=True)
    assert pyd == msgspec.to_builtins(MSGSPEC_DECODER.decode(body)), "the two schemas must read the body alike"
    cases = {
        "json.loads (floor, no schema)": lambda: json.loads(body),
        "msgspec.json.decode, untyped": lambda: msgspec.json.decode(body),
        "msgspec typed Struct decode": lambda: MSGSPEC_DECODER.decode(body),
        "pydantic model_validate_json": lambda: ChatRequest.model_validate_json(body),
        "pydantic json.loads + model_validate": lambda: ChatRequest.model_validate(json.loads(body)),
    }
    names = list(cases)
    times: dict[str, list[float]] = {name: [] for name in names}
    os.sched_setaffinity(0, {SERVER_CPU})
    try:
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                fn = cases[name]
                start = time.perf_counter_ns()
                for _ in range(batch):
                    fn()
                times[name].append((time.perf_counter_ns() - start) / batch / 1000)
    finally:
        os.sched_setaffinity(0, {LOAD_CPU})
    return {
        "body_bytes": len(body),
        "reps": reps,
        "batch": batch,
        "us_per_call": {n: {"median": statistics.median(t), "min": min(t), "max": max(t)} for n, t in times.items()},
    }


# --- one server under load ---


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds, all threads (grpc's included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, script_dir: Path, seconds: float, mean_ms: float) -> dict:
    script = script_dir / f"wrk-{mean_ms:g}.lua"
    if not script.exists():
        script.write_text(WRK_SCRIPT % {"body": sample_body().decode(), "mean_ms": mean_ms})
    cmd = ["taskset", "-c", str(LOAD_CPU), "wrk", "-t1", f"-c{CONNECTIONS}", f"-d{seconds:g}s", "-s", str(script), url]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    return result


def post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def check_serving(url: str, stub, validates: bool) -> None:
    """Both doors answer, and the schema refuses a bad body: else the numbers measure the wrong thing."""
    status, doc = post(url, sample_body())
    assert status == 200 and doc["choices"][0]["finish_reason"] == "stop", (status, doc)
    status, _ = post(url, invalid_body())
    assert status == (422 if validates else 200), status
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING


def probe_grpc(stub, stop: threading.Event, out: list[float]) -> None:
    while not stop.wait(0.2):
        start = time.perf_counter()
        stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        out.append((time.perf_counter() - start) * 1000)


def start_server(stack: str) -> tuple[subprocess.Popen, int, int]:
    port, grpc_port = free_port(), free_port()
    app = [str(HERE / "http_stack_apps.py"), "--stack", stack, "--port", str(port), "--grpc-port", str(grpc_port)]
    cmd = ["taskset", "-c", str(SERVER_CPU), sys.executable, *app]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"{stack} did not start (exit {proc.wait()})")
    return proc, port, grpc_port


def core_times() -> dict[int, tuple[int, int]]:
    """Busy and total jiffies of each CPU, from /proc/stat."""
    times = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[:8])
            busy = user + nice + system + irq + softirq + steal
            times[int(name[3:])] = (busy, busy + idle + iowait)
    return times


def busy_shares(before: dict, after: dict) -> dict[int, float]:
    return {cpu: (after[cpu][0] - before[cpu][0]) / max(after[cpu][1] - before[cpu][1], 1) for cpu in after}


def wait_quiet(pid: int, max_s: float) -> dict:
    """Waits (at least 1 s, at most max_s) for a second in which the host ran little besides this bench: other
    sessions share these 2 cores. Also the server's idle CPU (grpc's threads included) over that time."""
    start, cpu0 = time.monotonic(), cpu_s(pid)
    while True:
        before = core_times()
        time.sleep(1.0)
        shares = busy_shares(before, core_times())
        waited = time.monotonic() - start
        if sum(shares.values()) < QUIET_BUSY or waited >= max_s:
            idle_ms = (cpu_s(pid) - cpu0) * 1000 / waited
            return {"waited_s": waited, "host_busy": sum(shares.values()), "server_idle_cpu_ms_per_s": idle_ms}


def measured(pid: int, url: str, script_dir: Path, seconds: float, mean_ms: float) -> dict:
    """One wrk phase, with the server's CPU time and each core's busy share over it."""
    cpu0, cores0 = cpu_s(pid), core_times()
    result = wrk(url, script_dir, seconds, mean_ms)
    cpu, shares = cpu_s(pid) - cpu0, busy_shares(cores0, core_times())
    result["cpu_us_per_req"] = cpu * 1e6 / max(result["requests"], 1)
    result["cpu_share"] = cpu / (result["duration_us"] / 1e6)
    result["core_busy"] = shares
    # CPU 0's busy time that was not the server's: other work that took the server's core
    result["foreign_share_cpu0"] = max(shares[SERVER_CPU] - result["cpu_share"], 0.0)
    return result


def run_stack(stack: str, cfg: argparse.Namespace, script_dir: Path) -> dict:
    proc, port, grpc_port = start_server(stack)
    url = f"http://{HOST}:{port}{PATH}"
    try:
        with grpc.insecure_channel(f"{HOST}:{grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            check_serving(url, stub, stack not in NO_SCHEMA)
            quiet = wait_quiet(proc.pid, cfg.quiet_wait)
            wrk(url, script_dir, cfg.warmup, 0)
            stop, grpc_ms = threading.Event(), []
            prober = threading.Thread(target=probe_grpc, args=(stub, stop, grpc_ms), daemon=True)
            prober.start()
            sat = measured(proc.pid, url, script_dir, cfg.seconds, 0)
            stop.set()
            prober.join()
            fixed = measured(proc.pid, url, script_dir, cfg.seconds, CONNECTIONS * 1000 / cfg.rate)
            check_serving(url, stub, stack not in NO_SCHEMA)
    finally:
        proc.kill()
        proc.wait()
    sat["grpc_health_ms"] = {"p50": statistics.median(grpc_ms), "max": max(grpc_ms), "n": len(grpc_ms)}
    # what one core would serve, had the server had all of it: robust to other work on the core
    sat["core_capacity_rps"] = 1e6 / sat["cpu_us_per_req"]
    return {"saturation": sat, "fixed": fixed, "before": quiet}


# --- report ---

COLUMNS = (
    ("req/s per core (1e6 / CPU µs)", ("saturation", "core_capacity_rps"), "{:,.0f}"),
    ("CPU µs/req, saturated", ("saturation", "cpu_us_per_req"), "{:.0f}"),
    ("saturation req/s, measured", ("saturation", "rps"), "{:,.0f}"),
    ("server's CPU share, saturated", ("saturation", "cpu_share"), "{:.2f}"),
    ("other work on CPU 0, saturated", ("saturation", "foreign_share_cpu0"), "{:.2f}"),
    ("gRPC health p50 ms, saturated", ("saturation", "grpc_health_ms", "p50"), "{:.1f}"),
    ("fixed-rate req/s", ("fixed", "rps"), "{:,.0f}"),
    ("CPU µs/req, fixed rate", ("fixed", "cpu_us_per_req"), "{:.0f}"),
    ("p50 ms", ("fixed", "p50_us"), "{:.2f}"),
    ("p99 ms", ("fixed", "p99_us"), "{:.2f}"),
)


RANGED = ("req/s per core (1e6 / CPU µs)", "saturation req/s, measured", "CPU µs/req, fixed rate")


def dig(doc: dict, path: tuple[str, ...]) -> float:
    for key in path:
        doc = doc[key]
    return doc


def summarize(rounds: list[dict[str, dict]]) -> dict[str, dict[str, float]]:
    """Per stack, the median over rounds of each column (latencies in ms)."""
    summary = {}
    for stack in rounds[0]:
        row = {}
        for title, path, _ in COLUMNS:
            scale = 1000 if path[-1].endswith("_us") else 1
            values = [dig(r[stack], path) / scale for r in rounds]
            row[title] = statistics.median(values)
            row[title + " range"] = [min(values), max(values)]
        phases = [r[stack][k] for r in rounds for k in ("saturation", "fixed")]
        row["errors"] = sum(p["socket_errors"] + p["status_errors"] for p in phases)
        summary[stack] = row
    return summary


def table(summary: dict, schema: dict, rounds: int) -> str:
    base = summary.get(PLAN)
    head = ["stack", *(c[0] for c in COLUMNS), "vs plan, req/s per core", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for stack, row in sorted(summary.items(), key=lambda kv: kv[1]["CPU µs/req, saturated"]):
        cells = [fmt.format(row[title]) for title, _, fmt in COLUMNS]
        for i, (title, _, fmt) in enumerate(COLUMNS):
            if title in RANGED and rounds > 1:
                cells[i] += " [" + "–".join(fmt.format(v) for v in row[title + " range"]) + "]"
        rel = f"{base['CPU µs/req, saturated'] / row['CPU µs/req, saturated'] - 1:+.0%}" if base else "-"
        lines.append("| " + " | ".join([stack, *cells, rel, str(row["errors"])]) + " |")
    lines += ["", "Medians of the rounds, [lowest–highest]; latency at the fixed rate (wrk's, on the other core)."]
    batches = f"median of {schema['reps']} batches of {schema['batch']}; [min–max]"
    lines += ["", f"Body schema, µs per call on a {schema['body_bytes']}-byte body ({batches}):", ""]
    lines += ["| parser | µs/call | range |", "|---|---|---|"]
    for name, t in schema["us_per_call"].items():
        lines.append(f"| {name} | {t['median']:.2f} | {t['min']:.2f}–{t['max']:.2f} |")
    return "\n".join(lines) + "\n"


def host_info() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    flags = sorted(set(Path("/proc/cpuinfo").read_text().split()) & {"avx512f", "amx_tile", "avx2"})
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.splitlines()[0]
    versions = {"python": platform.python_version(), "kernel": platform.release(), "wrk": wrk_version}
    return {
        **versions,
        "cpu_model": model,
        "isa_flags": flags,
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "packages": {p: metadata.version(p) for p in PACKAGES.split()},
        "event_loop": "asyncio (default selector loop, no uvloop)",
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for results.json and table.md")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (1 round, 2-s phases)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="each saturation and fixed-rate phase")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rate", type=float, default=1000.0, help="fixed-rate target, req/s")
    parser.add_argument("--quiet-wait", type=float, default=8.0, help="most seconds to wait for a quiet host")
    parser.add_argument("--stacks", default=",".join(STACKS), help="comma-separated; also " + ", ".join(NO_SCHEMA))
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.warmup, args.quiet_wait = 1, 2.0, 1.0, 1.0
    return args


def log_round(r: int, stack: str, result: dict) -> None:
    sat, fixed = result["saturation"], result["fixed"]
    log(
        f"round {r + 1} {stack}: {sat['rps']:,.0f} req/s saturated, {sat['cpu_us_per_req']:.0f} µs/req; "
        f"fixed {fixed['rps']:,.0f} req/s, {fixed['cpu_us_per_req']:.0f} µs/req, "
        f"p50 {fixed['p50_us'] / 1000:.2f} ms, p99 {fixed['p99_us'] / 1000:.2f} ms; server share "
        f"{sat['cpu_share']:.2f}, other work on CPU 0 {sat['foreign_share_cpu0']:.2f} / "
        f"{fixed['foreign_share_cpu0']:.2f}; waited {result['before']['waited_s']:.0f} s"
    )


def main() -> None:
    args = parse_args()
    os.sched_setaffinity(0, {LOAD_CPU})
    started = datetime.datetime.now(datetime.UTC)
    info = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "start_utc": started.isoformat()}
    info |= {"host": host_info(), "args": {k: str(v) for k, v in vars(args).items()}}
    log("schema libraries")
    schema = schema_bench(reps=11 if args.quick else 41, batch=500 if args.quick else 2000)
    stacks = args.stacks.split(",")
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = stacks if r % 2 == 0 else stacks[::-1]
            rounds.append({})
            for stack in order:
                rounds[-1][stack] = run_stack(stack, args, Path(tmp))
                log_round(r, stack, rounds[-1][stack])
    summary = summarize(rounds)
    info["end_utc"] = datetime.datetime.now(datetime.UTC).isoformat()
    info["host"]["loadavg_end"] = os.getloadavg()
    text = table(summary, schema, len(rounds))
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {**info, "schema": schema, "summary": summary, "rounds": rounds}
        (args.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
        (args.out / "table.md").write_text(text)


if __name__ == "__main__":
    main()
