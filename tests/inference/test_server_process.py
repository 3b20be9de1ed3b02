"""The server process of a serving replica holds neither torch nor the weights: `zeroqueue serve` run as an
operator runs it, inspected from outside through /proc while it serves a call."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc

from services.pulse.replicas import free_port
from tests.client.test_scaleout import start

TORCH_LIBRARY = re.compile(r"libtorch\w*\.so")


def mapped_torch(pid: int) -> set[str]:
    """The torch shared libraries mapped into a process."""
    return set(TORCH_LIBRARY.findall(Path(f"/proc/{pid}/maps").read_text()))


def children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def test_a_serving_replicas_server_process_never_loads_torch(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROQUEUE_HOME", str(tmp_path))  # the embedded ledger and the outbox, as `make serve`
    subprocess.run([sys.executable, "-m", "services.cli", "migrate"], check=True, capture_output=True)
    port = free_port()
    log_path = tmp_path / "serve.log"
    args = ["serve", "--model", str(llama_dir), "--port", str(port)]
    args += ["--max-batch", "2", "--max-seq-len", "128", "--threads", "1", "--demo-tenant", "acme"]
    server = start(args, log_path, "zeroqueue: SERVING")
    try:
        key = re.search(r"its API key .*:\n\s+(\S+)", log_path.read_text()).group(1)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = pb.GenerateRequest(prompt="def add(a, b):", max_tokens=4, temperature=0.0)
            messages = list(stub.Generate(request, timeout=30, metadata=[("authorization", f"Bearer {key}")]))
        assert messages[-1].final.usage.sm_us > 0
        assert any(mapped_torch(child) for child in children(server.pid)), "the engine process runs torch"
        assert mapped_torch(server.pid) == set(), "the server process must not load torch"
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0, log_path.read_text()[-3000:]


def test_the_servers_modules_do_not_import_torch():
    modules = ("services.cli", "services.inference.replica", "services.inference.device.checkpoint")
    code = f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
