"""zeroqueue's HTTP door beside vLLM's OpenAI server (CPU build), on one seeded open-loop schedule (issue 32).

`zeroqueue pulse` cannot aim at vLLM: it reads the model's vocabulary and context through the replica's gRPC
ListModels, and its HTTP client leaves out the `model` field vLLM's server names its model by. This script reuses
pulse's pieces instead: the schedule (services/pulse/schedule.py: `plan`, same seed, the fixed shape's token-id
prompts, max_tokens, 2-s deadlines), the open-loop runner (runner.py: one task per call, sent at its planned time),
the HTTP client (http_client.py: the SDK's retrier, a 429 retried after its retry-after-ms / Retry-After when it
still fits the budget) and the statistics (stats.py), and runs the engines one at a time:

1. zeroqueue: `zeroqueue serve` on the model with its HTTP door (pulse's start_replica: its own ledger and key),
   each load's schedule through POST /v1/completions (prompt = token ids, temperature 0, stream false), then
   stopped;
2. vLLM: `../shared/peers/vllm_cpu.sh serve MODEL PORT --max-model-len N` (the bundled model's context is 512;
   the script's 2048 is overridden), each load's same schedule through its /v1/completions with the same body and
   `model: peer`, then stopped.

vLLM has no budget: a call's client timeout is its deadline (pulse's HttpClient waits 1 s past the budget for the
door's own 504; here GRACE_S is 0 for vLLM, so a call not answered by its deadline is dropped by the client, which
vLLM sees as a disconnect and aborts). goodput = calls completed inside their deadline per second of schedule, for
both. Each engine gets 8 sequential warm-up calls first (not counted).

    .venv/bin/python bench/http_pulse.py --capacity-json CAP.json --loads 1,2,4 --duration 20 \
        --out bench/results/http-pulse-2026-12-04/vllm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from services.client.retry import RetryConfig  # noqa: E402
from services.pulse import http_client  # noqa: E402
from services.pulse.http_client import HttpClient  # noqa: E402
from services.pulse.runner import run_plan  # noqa: E402
from services.pulse.schedule import LoadSpec, ShapeSpec, plan  # noqa: E402
from services.pulse.stats import summarize  # noqa: E402

VLLM_SH = ROOT.parent / "shared" / "peers" / "vllm_cpu.sh"
BUNDLED = ROOT / "services" / "inference" / "bundled" / "zq-python-tiny"


def utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())


def log(msg: str) -> None:
    print(f"[{utc()}] {msg}", file=sys.stderr, flush=True)


class ModelNamed:
    """An HttpClient whose calls name `model` (vLLM's server wants it; zeroqueue's door takes "" as its own)."""

    def __init__(self, client: HttpClient, model: str) -> None:
        self.client, self.model = client, model

    def generate(self, *args, **kwargs):
        kwargs.setdefault("model", self.model)
        return self.client.generate(*args, **kwargs)


async def _run(urls, api_key, model_name, requests, prefix, max_attempts):
    async with HttpClient(urls, api_key, retry=RetryConfig(max_attempts=max_attempts), max_connections=10_000) as c:
        client = ModelNamed(c, model_name) if model_name else c
        return await run_plan(client, requests, prefix)


async def _warm(url: str, api_key: str, model_name: str, vocab: int, n: int = 8) -> None:
    body = {"prompt": [16 + (7 * i) % (vocab - 16) for i in range(64)], "max_tokens": 32, "temperature": 0.0}
    if model_name:
        body["model"] = model_name
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        for _ in range(n):
            r = await http.post(
                url + "/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {api_key}", "X-Budget-Ms": "30000"},
            )
            r.raise_for_status()


def scrape_http(metrics_url: str | None) -> dict:
    """The replica's /metrics counters this comparison reads (None for vLLM: its own names differ)."""
    if not metrics_url:
        return {}
    from services.pulse.scrape import scrape

    try:
        samples = scrape(metrics_url)
    except OSError:
        return {}
    keep = (
        "zeroqueue_http_responses",
        "zeroqueue_requests_total",
        "zeroqueue_rejections_total",
        "zeroqueue_deadline_misses_total",
        "zeroqueue_refusals_total",  # by cause: why first attempts and retries were refused
        "zeroqueue_reservation_events_total",  # reserved, unbacked, held, lapsed, taken
    )
    out: dict = {}
    for (name, labels), value in samples.items():
        if name.startswith(keep):
            out[name + "{" + ",".join(f"{k}={v}" for k, v in labels) + "}"] = value
    return out


def summary_row(
    engine: str,
    load: float,
    qps: float,
    requests,
    traces,
    duration_s: float,
    before: dict,
    after: dict,
    la: tuple,
    t0: str,
    t1: str,
) -> dict:
    s = summarize(traces, duration_s)
    sent = s.num_sent
    timed_out = sum(1 for t in traces if t.outcome.value == "deadline_exceeded")
    late = sum(1 for t in traces if t.outcome.value == "ok" and not t.in_deadline)
    metrics = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) - before.get(k, 0)}
    return {
        "engine": engine,
        "load": load,
        "qps": qps,
        "planned": len(requests),
        "sent": sent,
        "admitted": s.num_admitted,
        "completed": s.num_completed,
        "in_deadline": s.num_in_deadline,
        "goodput_rps": s.goodput_rps,
        "attainment_of_admitted": (s.num_in_deadline / s.num_admitted) if s.num_admitted else None,
        "attainment_of_sent": (s.num_in_deadline / sent) if sent else None,
        "completed_late": late,
        "timed_out": timed_out,
        "outcomes": {str(k): v for k, v in s.outcomes.items()},
        "rejection_rate": s.rejection_rate,
        "avg_retries_per_rejected": s.avg_retries_per_rejected,
        "first_retry_success": s.first_retry_success_rate,
        "admitted_misses": s.num_admitted_misses,
        "admitted_p50_ms": s.admitted_latency_ms.p50,
        "admitted_p99_ms": s.admitted_latency_ms.p99,
        "latency_p50_ms": s.latency_ms.p50,
        "latency_p99_ms": s.latency_ms.p99,
        "mean_completion_tokens": s.mean_completion_tokens,
        "max_dispatch_lag_ms": s.max_dispatch_lag_ms,
        "loadavg_before": la,
        "started_utc": t0,
        "ended_utc": t1,
        "replica_metrics_delta": metrics,
        "summary": s.to_dict(),
    }


def run_loads(engine, url, api_key, model_name, metrics_url, loads, capacity, args, vocab, out, rows) -> None:
    shape = ShapeSpec("fixed", args.prompt_tokens, args.max_tokens, context_length=args.context)
    for i, load in enumerate(loads):
        if i:
            time.sleep(3.0)
        qps = load * capacity
        spec = LoadSpec(qps, args.duration, "poisson", seed=args.seed)
        requests = plan(spec, shape, vocab, args.deadline_ms)
        la, t0 = os.getloadavg(), utc()
        before = scrape_http(metrics_url)
        log(f"{engine} {load}x: {len(requests)} calls at {qps:.2f} qps for {args.duration:.0f} s, load avg {la}")
        traces = asyncio.run(_run([url], api_key, model_name, requests, f"hp-{engine}-{load}", args.max_attempts))
        time.sleep(0.5)
        after = scrape_http(metrics_url)
        row = summary_row(engine, load, qps, requests, traces, args.duration, before, after, la, t0, utc())
        rows.append(row)
        write_traces(out / f"trace-{engine}-{load}x.jsonl", traces)
        log(
            f"  goodput {row['goodput_rps']:.2f} req/s, in deadline {row['in_deadline']}/{row['sent']}, "
            f"refused first {row['rejection_rate']}, timed out {row['timed_out']}, late {row['completed_late']}, "
            f"admitted misses {row['admitted_misses']}, P50/P99 {row['admitted_p50_ms']}/{row['admitted_p99_ms']} ms"
        )


def run_zeroqueue(args, loads, capacity, vocab, out, rows) -> None:
    from services.pulse.replicas import start_replica
    from services.pulse.targets import Target, model_info

    log(f"zeroqueue: starting a deadline-mode replica on {args.model} with its HTTP door")
    replica = start_replica(Path(args.model), "deadline", out, args.serve_args.split(), http=True)
    try:
        model = asyncio.run(model_info(Target("zq", [replica.address], api_key=replica.api_key)))
        log(
            f"  SERVING {replica.address}, HTTP {replica.http_url}; ListModels vocab {model.vocab_size}, "
            f"context {model.context_length}"
        )
        if model.vocab_size != vocab:
            raise SystemExit(f"vocab {model.vocab_size} from ListModels != {vocab} from config.json")
        asyncio.run(_warm(replica.http_url, replica.api_key, "", vocab))
        run_loads(
            "zeroqueue",
            replica.http_url,
            replica.api_key,
            "",
            replica.metrics_url,
            loads,
            capacity,
            args,
            vocab,
            out,
            rows,
        )
    finally:
        replica.stop()
        log(f"zeroqueue stopped (log {replica.log_path})")


def write_traces(path: Path, traces) -> None:
    """One JSON line per call: its trace, its outcome by name."""
    with open(path, "w") as f:
        for t in traces:
            f.write(json.dumps({**t.__dict__, "outcome": t.outcome.value}) + "\n")


def start_server(cmd: list[str], url: str, log_path: Path, timeout_s: float, name: str) -> subprocess.Popen:
    """Starts a peer's OpenAI server (its own process group, output to `log_path`) and waits until `url`/v1/models
    answers 200; SystemExit if it exits first or is not ready in `timeout_s`."""
    started = time.monotonic()
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited with {proc.returncode}; see {log_path}")
            try:
                if httpx.get(url + "/v1/models", timeout=2, trust_env=False).status_code == 200:
                    return proc
            except httpx.TransportError:
                pass
            if time.monotonic() - started > timeout_s:
                raise SystemExit(f"{name} not ready after {timeout_s} s; see {log_path}")
            time.sleep(1.0)
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def run_vllm(args, loads, capacity, vocab, out, rows) -> None:
    url = f"http://127.0.0.1:{args.vllm_port}"
    log_path = out / "vllm.log"
    cmd = [
        "bash",
        str(VLLM_SH),
        "serve",
        str(Path(args.model).resolve()),
        str(args.vllm_port),
        "--max-model-len",
        str(args.context),
        *args.vllm_args.split(),
    ]
    log(f"vllm: {' '.join(cmd)}")
    started = time.monotonic()
    proc = start_server(cmd, url, log_path, args.vllm_timeout, "vLLM")
    try:
        log(f"  vLLM ready in {time.monotonic() - started:.0f} s")
        asyncio.run(_warm(url, "none", "peer", vocab))
        http_client.GRACE_S = 0.0  # the client's timeout is the call's deadline: no waiting for a 504 vLLM never sends
        run_loads("vllm", url, "none", "peer", None, loads, capacity, args, vocab, out, rows)
    finally:
        http_client.GRACE_S = 1.0
        stop_server(proc)
        log("vllm stopped")


def table(rows: list[dict]) -> str:
    head = (
        "| load | engine | sent | in deadline | goodput, req/s | attainment of admitted | refused at first attempt "
        "| retries per refused call | first-retry success | timed out / late | admitted P50 / P99, ms "
        "| mean output tokens | load avg (1 min) before |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    out = [head]

    def pct(v):
        return "—" if v is None else f"{v * 100:.2f} %"

    def num(v, f="{:.0f}"):
        return "—" if v is None else f.format(v)

    for r in sorted(rows, key=lambda r: (r["load"], r["engine"] != "zeroqueue")):
        out.append(
            f"| {r['load']:g}× ({r['qps']:.1f} req/s) | {r['engine']} | {r['sent']:,} | {r['in_deadline']:,} "
            f"| {r['goodput_rps']:.2f} | {pct(r['attainment_of_admitted'])} | {pct(r['rejection_rate'])} "
            f"| {num(r['avg_retries_per_rejected'], '{:.2f}')} | {pct(r['first_retry_success'])} "
            f"| {r['timed_out']} / {r['completed_late']} | {num(r['admitted_p50_ms'])} / {num(r['admitted_p99_ms'])} "
            f"| {num(r['mean_completion_tokens'], '{:.1f}')} | {r['loadavg_before'][0]:.2f} |"
        )
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capacity-json", required=True)
    p.add_argument("--loads", default="2")
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-ms", type=float, default=2000.0)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-attempts", type=int, default=RetryConfig.max_attempts)
    p.add_argument("--model", default=str(BUNDLED))
    p.add_argument("--context", type=int, default=512, help="vLLM's --max-model-len; the shape's context")
    p.add_argument("--engines", default="zeroqueue,vllm")
    p.add_argument("--serve-args", default="", help="extra `zeroqueue serve` arguments")
    p.add_argument("--vllm-port", type=int, default=8011)
    p.add_argument("--vllm-args", default="")
    p.add_argument("--vllm-timeout", type=float, default=400.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    capacity = json.loads(Path(args.capacity_json).read_text())["capacity_qps"]
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    loads = [float(x) for x in args.loads.split(",")]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows: list[dict] = []
    meta = {
        "started_utc": utc(),
        "git_head": head,
        "capacity_qps": capacity,
        "capacity_json": args.capacity_json,
        "args": vars(args),
        "vocab": vocab,
    }
    for engine in args.engines.split(","):
        {"zeroqueue": run_zeroqueue, "vllm": run_vllm}[engine](args, loads, capacity, vocab, out, rows)
        time.sleep(3.0)
    meta["ended_utc"] = utc()
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    md = table(rows)
    (out / "table.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
