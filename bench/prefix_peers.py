"""A shared system prompt, side by side (issue 33): zeroqueue with its prefix cache on and off, vLLM's CPU build with
prefix caching and llama.cpp's server with cache_prompt, on one seeded open-loop schedule over HTTP.

Every call is the same shared prefix (--prefix-tokens, default 1,024: the first tokens of a source file of this
repository, bench/shared_prefix_calls.py's document, as token ids of the model's tokenizer), then --fresh-tokens
(32) of its own, max_tokens 32, temperature 0, a --deadline-ms (2,000) budget. The first two fresh tokens spell the
call's serial number: no two calls of a run share even the first token past the prefix, no two calls at all the first
two, so nothing beyond the prefix can be served from a cache.
The model is bench/decode.py's SmolLM2-135M shape (random weights, bf16), context 2,048, 4 calls at once on every
engine. The engines run one at a time, each started once for all loads, in this order:

1. zq-cache: `zeroqueue serve --max-seq-len 2048 --max-batch 4` (prefix_cache_load.py's SERVE_ARGS) with its HTTP
   door, deadline admission; 429s retried as the SDK retries them;
2. zq-nocache: the same with --no-prefix-cache;
3. vllm: ../shared/peers/vllm_cpu.sh serve, --max-num-seqs 4 --enable-prefix-caching (and
   --enable-prompt-tokens-details, so its usage says what it served from the cache);
4. llamacpp: ../shared/peers/llama_cpp.sh serve on the bf16 GGUF of the same weights (`llama_cpp.sh gguf` makes it
   when it is missing), 4 slots, every call sent with `cache_prompt: true`.

Each engine first gets --warm (4) sequential calls (not counted, but reported: the first computes the shared prefix,
the others show a hit's idle cost; llama.cpp's go one to each of its slots, since a slot reuses only its own last
prompt). Capacity (1x) is zeroqueue's knee with the cache on: a short sweep of Poisson rates (--rates, --sweep-s
each, one attempt per call) on the zq-cache replica before its runs, the highest rate refusing at most
--knee-rejection of first attempts (the sweep stops at the first rate over it), as prefix_cache_load.py finds it;
--knee QPS skips the sweep.
Each load (--loads, x the knee) is the same schedule for every engine (pulse's `plan`, one seed), --duration s.

Calls stream (bench/sse_client.py): TTFT is send -> first output text at the client, as pulse's TTFT is over gRPC.
A peer's client timeout is the call's deadline (http_pulse.py's GRACE_S 0). goodput = calls completed inside their
deadline per second of schedule. Device time per call is zeroqueue's usage.device_time (core·µs on a CPU); the
cached prompt tokens per call are the usage's prompt_tokens_details.cached_tokens (llama.cpp: timings.cache_n).

    .venv/bin/python bench/prefix_peers.py --out bench/results/prefix-peers-<date>

stdout: one JSON document (results.json); --out DIR also gets table.md, traces and the servers' logs; logs: stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from decode import make_model  # noqa: E402
from http_pulse import ModelNamed, log, scrape_http, start_server, stop_server, summary_row, utc, write_traces  # noqa: E402
from prefix_cache_load import SERVE_ARGS  # noqa: E402
from prefix_table import ENGINES, goal, table, warm_table  # noqa: E402
from shared_prefix_calls import document  # noqa: E402
from sse_client import StreamingHttpClient, fill_first_tokens  # noqa: E402

from services.client.retry import RetryConfig  # noqa: E402
from services.pulse import http_client  # noqa: E402
from services.pulse.runner import run_plan  # noqa: E402
from services.pulse.schedule import LoadSpec, ShapeSpec, plan  # noqa: E402
from services.pulse.stats import percentile, summarize  # noqa: E402

PEERS = ROOT.parent / "shared" / "peers"
FIRST_ID = 16  # pulse's plan draws token ids from here up: the low special ids stay out
RUN_SPAN = 1_000_000  # serial numbers per run: a run's calls are numbered base + index
CONTEXT = 2048
SLOTS = 4  # calls at once on every engine: zeroqueue's --max-batch, vLLM's --max-num-seqs, llama.cpp's slots
REFUSED = ("rejected", "infeasible", "quota_exceeded")  # never admitted: 429s to the end, a budget no replica meets


def prefix_ids(model_dir: Path, num_tokens: int) -> tuple[int, ...]:
    """The shared prefix: the document's first `num_tokens` token ids by the model's own tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tuple(tokenizer.encode(document(num_tokens + 64)).ids[:num_tokens])
    if len(ids) < num_tokens:
        raise SystemExit(f"the document has only {len(ids)} tokens, not {num_tokens}")
    return ids


def stamp(serial: int, vocab: int) -> tuple[int, int]:
    """A call's serial number as two token ids in [FIRST_ID, vocab): different for every serial below
    (vocab - FIRST_ID)², and the first differs between any two serials less than vocab - FIRST_ID apart."""
    base = vocab - FIRST_ID
    if not 0 <= serial < base * base:
        raise ValueError(f"serial {serial} out of range")
    return FIRST_ID + serial % base, FIRST_ID + serial // base


def with_prefix(requests, prefix: tuple[int, ...], serial_base: int, vocab: int) -> list:
    """pulse's planned calls (their token ids are the fresh part) with the shared prefix in front and their serial
    stamped on the first two fresh tokens."""
    return [
        replace(r, prompt_token_ids=prefix + stamp(serial_base + r.index, vocab) + r.prompt_token_ids[2:])
        for r in requests
    ]


def schedule(args, qps: float, duration_s: float, run: int) -> list:
    """One run's calls: pulse's plan (seed --seed, so every engine gets the same), serials from run × RUN_SPAN."""
    shape = ShapeSpec("fixed", args.fresh_tokens, args.max_tokens, context_length=CONTEXT - args.prefix_tokens)
    requests = plan(LoadSpec(qps, duration_s, "poisson", seed=args.seed), shape, args.vocab, args.deadline_ms)
    return with_prefix(requests, args.prefix, run * RUN_SPAN, args.vocab)


class Engine:
    """One server under test: where it answers, how its calls are named, and what each call adds to its body."""

    def __init__(self, name: str, url: str, api_key: str = "none", model: str = "", extra=None, metrics=None):
        self.name, self.url, self.api_key, self.model = name, url, api_key, model
        self.extra, self.metrics_url = dict(extra or {}), metrics
        self.slots = SLOTS if name == "llamacpp" else 0  # llama.cpp caches per slot: warm-up call i goes to slot i
        self.grace_s = 1.0 if name.startswith("zq") else 0.0  # a peer never sends the door's 504

    async def run(self, requests, id_prefix: str, max_attempts: int):
        http_client.GRACE_S = self.grace_s
        retry = RetryConfig(max_attempts=max_attempts)
        try:
            async with StreamingHttpClient(
                [self.url], self.api_key, retry=retry, max_connections=10_000, extra=self.extra
            ) as client:
                traces = await run_plan(ModelNamed(client, self.model) if self.model else client, requests, id_prefix)
        finally:
            http_client.GRACE_S = 1.0
        fill_first_tokens(client, traces, id_prefix)
        return traces, client.cached_tokens

    def warm(self, args) -> list[dict]:
        """--warm sequential calls, each the prefix and fresh tokens of its own; 503s (still loading) waited out.
        llama.cpp's go to its slots in turn (`id_slot`): each slot reuses only its own last prompt, and sequential
        calls would otherwise all land on one slot, leaving the prefix to be computed by the measured calls.
        Returns each call's latency, device time and cached prompt tokens: the idle cost of a miss and of hits (with
        the cache off, the only device time a 2-s budget may leave to see)."""
        calls = schedule(args, 1.0, 60.0, 0)[: args.warm]
        warm = asyncio.run(self._warm(calls))
        log(f"  warm-up: {warm}")
        return warm

    async def _warm(self, calls) -> list[dict]:
        seen = []
        headers = {"Authorization": f"Bearer {self.api_key}", "X-Budget-Ms": "60000"}
        async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
            for i, call in enumerate(calls):
                body = {"prompt": list(call.prompt_token_ids), "max_tokens": call.max_tokens, "temperature": 0.0}
                body |= self.extra | ({"model": self.model} if self.model else {})
                body |= {"id_slot": i % self.slots} if self.slots else {}
                for _ in range(60):
                    t0 = time.monotonic()
                    r = await http.post(self.url + "/v1/completions", json=body, headers=headers)
                    if r.status_code != 503:
                        break
                    await asyncio.sleep(1.0)
                r.raise_for_status()
                seen.append(warm_record(r.json(), time.monotonic() - t0))
        return seen


def warm_record(body: dict, seconds: float) -> dict:
    """A whole reply's latency (ms), device time (core·ms, zeroqueue's) and cached prompt tokens (if said)."""
    usage = body.get("usage") or {}
    device = (usage.get("device_time") or {}).get("amount")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    cached = (body.get("timings") or {}).get("cache_n", cached)
    return {
        "latency_ms": round(seconds * 1000, 1),
        "device_ms": None if device is None else device / 1000,
        "cached_tokens": cached,
        "completion_tokens": usage.get("completion_tokens"),
    }


def extra_fields(traces, cached: dict, id_prefix: str) -> dict:
    """What summary_row leaves out: TTFT, device time and cached prompt tokens per completed call, and why the
    calls never admitted were refused (the 429's cause, else the error's reason, such as DEADLINE_INFEASIBLE)."""
    done = [t for t in traces if t.outcome.value == "ok"]
    device = [t.device_us / 1000 for t in done if t.device_us is not None]
    hits = [cached[f"{id_prefix}-{t.index}"] for t in done if f"{id_prefix}-{t.index}" in cached]
    ttft = [(t.first_token_s - t.sent_s) * 1000 for t in done if t.first_token_s is not None]
    refused = [t for t in traces if t.outcome.value in REFUSED]
    return {
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_count": len(ttft),
        "device_ms_per_call": sum(device) / len(device) if device else None,
        "device_p50_ms": percentile(device, 50),
        "cached_tokens_per_call": sum(hits) / len(hits) if hits else None,
        "refused": len(refused),
        "refused_by_cause": dict(Counter(t.refusal_cause or t.error.split("/")[-1] or "unsaid" for t in refused)),
    }


def run_load(engine: Engine, args, load: float, knee: float, run: int) -> dict:
    qps = load * knee
    requests = schedule(args, qps, args.duration, run)
    id_prefix = f"pp-{engine.name}-{load:g}x"
    la, t0, before = os.getloadavg(), utc(), scrape_http(engine.metrics_url)
    log(f"{engine.name} {load:g}x: {len(requests)} calls at {qps:.2f} qps for {args.duration:.0f} s, load avg {la}")
    traces, cached = asyncio.run(engine.run(requests, id_prefix, args.max_attempts))
    time.sleep(0.5)
    after = scrape_http(engine.metrics_url)
    row = summary_row(engine.name, load, qps, requests, traces, args.duration, before, after, la, t0, utc())
    row |= extra_fields(traces, cached, id_prefix)
    if args.out:
        write_traces(args.out / f"trace-{engine.name}-{load:g}x.jsonl", traces)
    log(
        f"  goodput {row['goodput_rps']:.2f}/s, in deadline {row['in_deadline']}/{row['sent']}, refused "
        f"{row['refused']} {row['refused_by_cause']}, timed out {row['timed_out']}, TTFT P50/P99 "
        f"{row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms, device {row['device_ms_per_call']} ms, cached "
        f"{row['cached_tokens_per_call']}, out tokens {row['mean_completion_tokens']}"
    )
    return row


def run_loads(engine: Engine, args, state: dict) -> None:
    """Every load on `engine`, 3 s apart (as http_pulse.py: the last calls' aborts settle)."""
    for i, load in enumerate(args.loads):
        if i:
            time.sleep(3.0)
        state["rows"].append(run_load(engine, args, load, state["knee"], 1 + i))


def sweep(engine: Engine, args) -> tuple[float, list[dict]]:
    """The knee: the highest rate whose first attempts were refused at most --knee-rejection (one attempt a call),
    stopping at the first rate over it; the lowest rate if none fits."""
    points, knee = [], None
    for i, qps in enumerate(args.rates):
        requests = schedule(args, qps, args.sweep_s, 100 + i)
        traces, _ = asyncio.run(engine.run(requests, f"pp-sweep-{qps:g}", 1))
        s = summarize(traces, args.sweep_s)
        refused = s.rejection_rate or 0.0
        points.append({"qps": qps, "sent": s.num_sent, "first_attempt_refused": refused, "goodput": s.goodput_rps})
        log(f"  sweep {qps:g} qps: refused {refused:.1%} of {s.num_sent}, goodput {s.goodput_rps:.2f}/s")
        if refused > args.knee_rejection:
            break
        knee = qps
    return (knee if knee is not None else min(args.rates)), points


def run_zeroqueue(name: str, args, state: dict) -> None:
    from services.pulse.replicas import start_replica

    extra = ["--no-prefix-cache"] if name == "zq-nocache" else []
    workdir = args.out or Path(args.tmp)
    replica = start_replica(args.model, "deadline", workdir, [*SERVE_ARGS, *extra], name=name, http=True)
    try:
        log(f"{name}: SERVING, HTTP {replica.http_url} (log {replica.log_path})")
        engine = Engine(name, replica.http_url, replica.api_key, metrics=replica.metrics_url)
        state["warm"][name] = engine.warm(args)
        if state.get("knee") is None:
            state["knee"], state["sweep"] = sweep(engine, args)
            log(f"  knee {state['knee']:g} qps")
        run_loads(engine, args, state)
    finally:
        replica.stop()


def peer_command(name: str, args) -> list[str]:
    if name == "vllm":
        model = str(args.model.resolve())
        tail = ["--max-model-len", str(CONTEXT), "--max-num-seqs", str(SLOTS), "--enable-prefix-caching"]
        tail += ["--enable-prompt-tokens-details", *args.vllm_args.split()]
        return ["bash", str(PEERS / "vllm_cpu.sh"), "serve", model, str(args.port), *tail]
    return ["bash", str(PEERS / "llama_cpp.sh"), "serve", str(gguf(args.model)), str(args.port), str(SLOTS)]


def gguf(model: Path) -> Path:
    """The bf16 GGUF `llama_cpp.sh gguf` writes for `model`; made first if missing."""
    root = Path(os.environ.get("ZQ_PEERS", Path.home() / ".cache" / "zq-peers"))
    path = root / "gguf" / f"{model.resolve().name}-bf16.gguf"
    if not path.exists():
        log(f"llamacpp: converting {model} to {path}")
        subprocess.run(["bash", str(PEERS / "llama_cpp.sh"), "gguf", str(model), "bf16"], check=True, stdout=2)
    return path


def run_peer(name: str, args, state: dict) -> None:
    if state.get("knee") is None:
        raise SystemExit("no knee: run zq-cache first or give --knee QPS")
    url, cmd = f"http://127.0.0.1:{args.port}", peer_command(name, args)
    log(f"{name}: {' '.join(cmd)}")
    started = time.monotonic()
    proc = start_server(cmd, url, Path(args.out or args.tmp) / f"{name}.log", args.peer_timeout, name)
    try:
        log(f"  ready in {time.monotonic() - started:.0f} s")
        engine = Engine(name, url, model="peer", extra={"cache_prompt": True} if name == "llamacpp" else None)
        state["warm"][name] = engine.warm(args)
        run_loads(engine, args, state)
    finally:
        stop_server(proc)
        log(f"{name} stopped")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="zq,vllm,llamacpp", help=f"of {', '.join(ENGINES)}; zq: both zq modes")
    p.add_argument("--loads", default="1,2,4", help="× the knee")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per load")
    p.add_argument("--knee", type=float, default=None, help="capacity, calls/s: skips the sweep")
    p.add_argument("--rates", default="1,1.5,2,2.5,3,3.5,4,5,6,8", help="the sweep's Poisson rates, calls/s")
    p.add_argument("--sweep-s", type=float, default=20.0)
    p.add_argument("--knee-rejection", type=float, default=0.03)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--fresh-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--deadline-ms", type=float, default=2000.0)
    p.add_argument("--max-attempts", type=int, default=RetryConfig.max_attempts, help="zeroqueue's tries per call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm", type=int, default=SLOTS, help="sequential warm-up calls per engine")
    p.add_argument("--model", type=Path, default=None, help="default: bench/decode.py's SmolLM2-135M shape")
    p.add_argument("--port", type=int, default=8011, help="a peer's port")
    p.add_argument("--vllm-args", default="")
    p.add_argument("--peer-timeout", type=float, default=400.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--tmp", default="/tmp/prefix-peers", help="replica data and logs without --out")
    args = p.parse_args(argv)
    names = [n for e in args.engines.split(",") for n in (("zq-cache", "zq-nocache") if e == "zq" else (e,))]
    if unknown := set(names) - set(ENGINES):
        p.error(f"unknown engines {sorted(unknown)}; choose of {', '.join(ENGINES)}")
    args.engines = [e for e in ENGINES if e in names]
    args.loads = [float(x) for x in args.loads.split(",")]
    args.rates = sorted(float(x) for x in args.rates.split(","))
    if args.fresh_tokens < 2:
        p.error("--fresh-tokens must be >= 2 (the serial takes two)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    args.model = args.model or make_model()
    args.vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    args.prefix = prefix_ids(args.model, args.prefix_tokens)
    for d in (args.out, Path(args.tmp)):
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    meta = {"started_utc": utc(), "git_head": head.strip(), "serve_args": SERVE_ARGS, "host_cpus": os.cpu_count()}
    meta["args"] = {k: str(v) for k, v in vars(args).items() if k != "prefix"}
    state: dict = {"knee": args.knee, "sweep": [], "rows": [], "warm": {}}
    for name in args.engines:
        (run_zeroqueue if name.startswith("zq") else run_peer)(name, args, state)
        time.sleep(3.0)
    meta["ended_utc"] = utc()
    result = {"meta": meta, "knee_qps": state["knee"], "sweep": state["sweep"], "warm_up": state["warm"]}
    result["rows"] = state["rows"]
    result["goal"] = goal(state["rows"])
    if args.out:
        (args.out / "results.json").write_text(json.dumps(result, indent=1, default=str))
        md = table(state["rows"], state["knee"], result["goal"]) + "\n\n" + warm_table(state["warm"])
        (args.out / "table.md").write_text(md + "\n")
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
