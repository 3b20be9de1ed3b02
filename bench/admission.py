"""How fast is "no"? Arrival-to-decision and rejection-reply latency on a loaded replica.

Starts `zeroqueue serve` as its own process (services/pulse/replicas.py), keeps every KV slot busy with long
generations (the engine computes all the while), then sends N calls one after another that the full replica must
refuse. It does so twice, side by side: the engine in its own process (the default) and on a thread of the
server (`--engine-thread`). Reports, per arm:
  - server side: arrival -> admission decision, from the zeroqueue_admission_seconds histogram
    (interpolated within 50 µs buckets, as Prometheus' histogram_quantile does);
  - server side: arrival -> the refusal handed to gRPC (zeroqueue_refusal_reply_seconds: the decision and the
    status details; the log line follows the reply);
  - client side: call start -> RESOURCE_EXHAUSTED received, measured here over loopback (this includes the
    bench process's own delays: its 8 loader threads stream tokens in Python).

    python bench/admission.py [--model DIR] [--requests 10000] [--arms engine-process,engine-thread]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from zeroqueue.inference.v1 import inference_pb2 as pb  # noqa: E402
from zeroqueue.inference.v1 import inference_pb2_grpc  # noqa: E402

from services.client.auth import authorized_channel  # noqa: E402
from services.inference.bundled_model import BUNDLED_MODEL  # noqa: E402
from services.logs import configure_logging  # noqa: E402
from services.pulse.replicas import start_replica  # noqa: E402


def keep_busy(stub, stop: threading.Event, errors: list) -> None:
    """One slot's worth of load: back-to-back long generations until told to stop."""
    while not stop.is_set():
        try:
            for _ in stub.Generate(
                pb.GenerateRequest(prompt="def main():", max_tokens=400, temperature=0.8), timeout=600
            ):
                if stop.is_set():
                    break
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED and not stop.is_set():
                errors.append(f"{error.code().name}/{reason(error)}")
            time.sleep(0.005)


def reason(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return "-"


def histogram_quantile(text: str, name: str, q: float) -> float:
    buckets = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1]
    rank, prev_le, prev_count = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-9)
        prev_le, prev_count = le, count
    return prev_le


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


ARMS = {"engine-process": [], "engine-thread": ["--engine-thread"]}


def run_arm(args: argparse.Namespace, flags: list[str]) -> dict:
    """One replica, loaded and refusing `args.requests` calls; its decision and rejection latencies."""
    workdir = Path(tempfile.mkdtemp(prefix="zq-admission-"))
    replica = start_replica(
        args.model, "deadline", workdir, ["--max-batch", str(args.slots), "--max-seq-len", "512", *flags]
    )
    stop, errors = threading.Event(), []
    stub = inference_pb2_grpc.InferenceStub(authorized_channel(replica.address, replica.api_key))
    loaders = [threading.Thread(target=keep_busy, args=(stub, stop, errors), daemon=True) for _ in range(args.slots)]
    try:
        for t in loaders:
            t.start()
        time.sleep(2.0)  # let every slot fill
        client_ms, codes = [], {}
        for i in range(args.requests):
            t0 = time.perf_counter()
            try:
                list(
                    stub.Generate(
                        pb.GenerateRequest(prompt="x = 1", max_tokens=64, request_id=f"bench-{i}"), timeout=60
                    )
                )
                codes["OK"] = codes.get("OK", 0) + 1
            except grpc.RpcError as error:
                elapsed_ms = (time.perf_counter() - t0) * 1000
                key = f"{error.code().name}/{reason(error)}"
                codes[key] = codes.get(key, 0) + 1
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    client_ms.append(elapsed_ms)
        text = urllib.request.urlopen(replica.metrics_url).read().decode()
    finally:
        stop.set()
        replica.stop()
        for t in loaders:
            t.join(30)
    name = "zeroqueue_admission_seconds"
    return {
        "codes": codes,
        "loader_errors": sorted(set(errors)),
        "cost_model": {
            name: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            for name in ("zeroqueue_cost_model_ratio", "zeroqueue_cost_model_deviation")
            if line.startswith(name + " ")
        },
        "server_decision_ms": {
            "p50": round(histogram_quantile(text, name, 0.5) * 1000, 3),
            "p99": round(histogram_quantile(text, name, 0.99) * 1000, 3),
            "note": "all admission decisions of the run, loaders included; 50 µs buckets",
        },
        "server_refusal_reply_ms": {
            "p50": round(histogram_quantile(text, "zeroqueue_refusal_reply_seconds", 0.5) * 1000, 3),
            "p99": round(histogram_quantile(text, "zeroqueue_refusal_reply_seconds", 0.99) * 1000, 3),
            "note": "arrival to the refusal handed to gRPC (decision, status details); all refusals",
        },
        "client_rejection_ms": {
            "p50": round(statistics.median(client_ms), 3),
            "p99": round(percentile(client_ms, 0.99), 3),
            "max": round(max(client_ms), 3),
        }
        if client_ms
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    args = parser.parse_args()
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "model": args.model.name,
        "slots": args.slots,
        "requests": args.requests,
        "arms": {},
    }
    for arm in args.arms.split(","):
        report["arms"][arm] = run_arm(args, ARMS[arm])
        print(json.dumps({arm: report["arms"][arm]}), file=sys.stderr, flush=True)
    if len(report["arms"]) > 1:
        p99 = {arm: r["server_decision_ms"]["p99"] for arm, r in report["arms"].items()}
        report["decision_p99_ratio_process_over_thread"] = round(
            p99.get("engine-process", 0) / max(p99.get("engine-thread", 1e-9), 1e-9), 3
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    main()
