"""A replica serving over TLS: a client that trusts the certificate streams; a plaintext one cannot."""

from __future__ import annotations

import socket
import subprocess
import sys

import grpc
import pytest
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc

from services.client.auth import BearerAuth
from services.inference.device.executor import ExecutorConfig
from services.inference.serve_config import ServeConfig
from tests.inference.harness import ServerThread


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(folder / "key.pem"),
            "-out",
            str(folder / "cert.pem"),
        ],
        check=True,
        capture_output=True,
    )
    return folder / "cert.pem", folder / "key.pem"


def test_tls_replica_streams_to_a_trusting_client_only(llama_dir, certificate):
    cert, key = certificate
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        health_port = sock.getsockname()[1]
    config = ServeConfig(
        str(llama_dir),
        port=0,
        tls_cert=str(cert),
        tls_key=str(key),
        health_port=health_port,
        executor=ExecutorConfig(max_batch=2, max_seq_len=256),
    )
    server = ServerThread(config).start()
    try:
        channel = grpc.intercept_channel(
            grpc.secure_channel(server.address, grpc.ssl_channel_credentials(cert.read_bytes())), BearerAuth(server.key)
        )
        messages = list(
            inference_pb2_grpc.InferenceStub(channel).Generate(
                pb.GenerateRequest(prompt="def f():", max_tokens=4, temperature=0.0), timeout=20
            )
        )
        assert messages[-1].final.usage.completion_tokens == 4
        with pytest.raises(grpc.RpcError) as info:
            list(server.stub().Generate(pb.GenerateRequest(prompt="x", max_tokens=2), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        health = subprocess.run(
            [sys.executable, "-m", "services.cli", "health", "--address", server.address, "--tls-ca", str(cert)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert health.returncode == 0 and "SERVING" in health.stdout
        plain = subprocess.run(
            [sys.executable, "-m", "services.cli", "health", "--address", f"127.0.0.1:{health_port}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert plain.returncode == 0, "kubelet probes use the plaintext health port"
    finally:
        server.stop()
