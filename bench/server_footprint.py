"""The server process's footprint: its memory and its start-up, for one or more source trees side by side.

Each run starts `zeroqueue serve` on the bundled model with a fresh embedded ledger (as `make serve` does, with a
demo tenant), and measures from the spawn:
- listening_s: until the gRPC health service first answers (NOT_SERVING while the engine warms up);
- serving_s: until the replica prints SERVING (engine loaded, warmed up and calibrated);
- the server process's RSS once SERVING and its peak (VmHWM) after one Generate call, whether torch is mapped
  into it, and the engine child's RSS beside it.
Trees alternate run by run, so a before/after pair shares the host's state. Give a tree as a path to a checkout
(e.g. a `git worktree` of an older commit); it runs on this venv's packages with that tree first on sys.path.

    python bench/server_footprint.py --tree . --tree ../before --runs 3 --out bench/results/footprint/DATE
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "bench")]

from soak_checks import engine_children, host_info, rss_kb  # noqa: E402  (bench/soak_checks.py)
from zeroqueue.inference.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402

from services.logs import configure_logging  # noqa: E402
from services.pulse.replicas import free_port  # noqa: E402

MODEL = ROOT / "services/inference/bundled/zq-python-tiny"
TORCH_LIBRARY = re.compile(r"libtorch\w*\.so")
KEY_LINE = re.compile(r"its API key .*:\n\s+(\S+)")


def peak_kib(pid: int) -> int:
    """The process's peak resident set (VmHWM) in KiB."""
    return int(re.search(r"^VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE).group(1))


def maps_torch(pid: int) -> bool:
    return bool(TORCH_LIBRARY.search(Path(f"/proc/{pid}/maps").read_text()))


def health_answers(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.2)
        except grpc.RpcError:
            return False
    return True


def one_call(port: int, key: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(prompt="def add(a, b):", max_tokens=8, temperature=0.0)
        messages = list(stub.Generate(request, timeout=60, metadata=[("authorization", f"Bearer {key}")]))
    return messages[-1].final.usage.sm_us


def measure(tree: Path, home: Path, timeout_s: float) -> dict:
    """One start of `zeroqueue serve` from `tree`: its times and memory, then a clean stop."""
    env = dict(os.environ, ZEROQUEUE_HOME=str(home), PYTHONPATH=f"{tree}{os.pathsep}{tree / 'protos'}")
    cli = [sys.executable, "-m", "services.cli"]
    subprocess.run([*cli, "migrate"], cwd=tree, env=env, check=True, capture_output=True)
    port, log_path = free_port(), home / "serve.log"
    args = ["serve", "--model", str(MODEL), "--port", str(port), "--demo-tenant", "bench", "--no-json-logs"]
    with open(log_path, "w") as log:
        started = time.perf_counter()
        server = subprocess.Popen([*cli, *args], cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        listening_s = serving_s = None
        while serving_s is None:
            if server.poll() is not None or time.perf_counter() - started > timeout_s:
                raise RuntimeError(f"{tree}: serve did not reach SERVING:\n{log_path.read_text()[-2000:]}")
            if listening_s is None and health_answers(port):
                listening_s = time.perf_counter() - started
            if "zeroqueue: SERVING" in log_path.read_text(errors="replace"):
                serving_s = time.perf_counter() - started
            time.sleep(0.02)
        rss_kib = rss_kb(server.pid)
        engine = engine_children(server.pid)
        sm_us = one_call(port, KEY_LINE.search(log_path.read_text()).group(1))
        return {
            "listening_s": round(listening_s or serving_s, 3),
            "serving_s": round(serving_s, 3),
            "server_rss_mib": round(rss_kib / 1024, 1),
            "server_peak_mib": round(peak_kib(server.pid) / 1024, 1),
            "server_maps_torch": maps_torch(server.pid),
            "engine_rss_mib": round(sum(rss_kb(pid) or 0 for pid in engine) / 1024, 1),
            "call_sm_us": sm_us,
        }
    finally:
        server.terminate()
        server.wait(timeout=60)


def summary(runs: list[dict]) -> dict:
    keys = ("listening_s", "serving_s", "server_rss_mib", "server_peak_mib", "engine_rss_mib")
    out = {key: statistics.median(run[key] for run in runs) for key in keys}
    out["server_maps_torch"] = any(run["server_maps_torch"] for run in runs)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", type=Path, help="a source tree (repeat; default: this one)")
    parser.add_argument("--runs", type=int, default=3, help="starts per tree, alternating")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json")
    args = parser.parse_args()
    trees = [tree.resolve() for tree in args.tree or [ROOT]]
    runs: dict[str, list[dict]] = {str(tree): [] for tree in trees}
    for i in range(args.runs):
        for tree in trees:
            with tempfile.TemporaryDirectory() as home:
                run = measure(tree, Path(home), args.timeout_s)
            runs[str(tree)].append(run)
            print(f"run {i + 1} {tree.name}: {json.dumps(run)}", flush=True)
    header = ("listening s", "SERVING s", "server MiB", "peak MiB", "engine MiB")
    print(f"\n{'tree':<24} " + " ".join(f"{h:>11}" for h in header) + " torch")
    for tree, tree_runs in runs.items():
        s = summary(tree_runs)
        print(
            f"{Path(tree).name:<24} {s['listening_s']:>11.2f} {s['serving_s']:>11.2f} {s['server_rss_mib']:>11.1f} "
            f"{s['server_peak_mib']:>11.1f} {s['engine_rss_mib']:>11.1f} {'yes' if s['server_maps_torch'] else 'no'}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"host": host_info(), "runs": runs, "medians": {tree: summary(r) for tree, r in runs.items()}}
        (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    configure_logging()  # every line on stderr: stdout is the bench's report
    sys.exit(main())
