"""How fast is "no"? Arrival-to-decision and rejection-reply latency on a loaded replica.

Starts `zeroqueue serve` as its own process, keeps every KV slot busy with long generations (the engine
computes all the while), then sends N calls one after another that the full replica must refuse. Reports:
  - server side: arrival -> admission decision, from the zeroqueue_admission_seconds histogram
    (interpolated within 50 µs buckets, as Prometheus' histogram_quantile does);
  - client side: call start -> RESOURCE_EXHAUSTED received, measured here over loopback.

    python bench/admission.py [--model DIR] [--requests 10000]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
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

DEFAULT_MODEL = ROOT / "services/inference/bundled/zq-python-tiny"


def start_server(model: Path, port: int, metrics_port: int, slots: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.cli", "serve", "--model", str(model), "--port", str(port),
           "--metrics-port", str(metrics_port), "--max-batch", str(slots), "--max-seq-len", "512"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if "SERVING" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc
    raise RuntimeError("server exited before SERVING")


def keep_busy(stub, stop: threading.Event, errors: list) -> None:
    """One slot's worth of load: back-to-back long generations until told to stop."""
    while not stop.is_set():
        try:
            for _ in stub.Generate(pb.GenerateRequest(prompt="def main():", max_tokens=400, temperature=0.8),
                                   timeout=120):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--port", type=int, default=50151)
    parser.add_argument("--metrics-port", type=int, default=9151)
    args = parser.parse_args()
    server = start_server(args.model, args.port, args.metrics_port, args.slots)
    stop, errors = threading.Event(), []
    channel = grpc.insecure_channel(f"127.0.0.1:{args.port}")
    stub = inference_pb2_grpc.InferenceStub(channel)
    loaders = [threading.Thread(target=keep_busy, args=(stub, stop, errors), daemon=True) for _ in range(args.slots)]
    try:
        for t in loaders:
            t.start()
        time.sleep(2.0)                                 # let every slot fill
        metrics_url = f"http://127.0.0.1:{args.metrics_port}/metrics"
        client_ms, codes = [], {}
        for i in range(args.requests):
            t0 = time.perf_counter()
            try:
                list(stub.Generate(pb.GenerateRequest(prompt="x = 1", max_tokens=64, request_id=f"bench-{i}"),
                                   timeout=10))
                codes["OK"] = codes.get("OK", 0) + 1
            except grpc.RpcError as error:
                elapsed_ms = (time.perf_counter() - t0) * 1000
                key = f"{error.code().name}/{reason(error)}"
                codes[key] = codes.get(key, 0) + 1
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    client_ms.append(elapsed_ms)
        text = urllib.request.urlopen(metrics_url).read().decode()
    finally:
        stop.set()
        server.terminate()
        server.wait(30)
    name = "zeroqueue_admission_seconds"
    report = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores", "model": args.model.name, "slots": args.slots, "requests": args.requests,
        "codes": codes, "loader_errors": sorted(set(errors)),
        "server_decision_ms": {"p50": round(histogram_quantile(text, name, 0.5) * 1000, 3),
                               "p99": round(histogram_quantile(text, name, 0.99) * 1000, 3),
                               "note": "all admission decisions of the run, loaders included; 50 µs buckets"},
        "client_rejection_ms": {"p50": round(statistics.median(client_ms), 3),
                                "p99": round(percentile(client_ms, 0.99), 3),
                                "max": round(max(client_ms), 3)} if client_ms else None,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
