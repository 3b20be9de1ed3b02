"""Replicas the pulse tool starts itself: `zeroqueue serve` processes on loopback, each with its own data
directory, embedded SQLite ledger, tenant key and metrics port (and, when asked, its HTTP door's port), logging to a
file there."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from billing.private_files import private_dir


@dataclass
class ReplicaProcess:
    admission: str
    address: str
    metrics_url: str
    api_key: str
    log_path: Path
    proc: subprocess.Popen
    ledger_url: str = ""
    http_url: str = ""  # the HTTP door's base URL, when it was started with one

    def create_tenant(self, name: str) -> str:
        """A tenant of this name in the replica's ledger; its API key."""
        from billing import commands

        return commands.create_tenant(self.ledger_url, name)

    def stop(self, grace_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int | None) -> bool:
    """Whether 127.0.0.1:`port` accepts a connection now (None: no port to wait for)."""
    if port is None:
        return True
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def start_replica(
    model: Path,
    admission: str,
    workdir: Path,
    serve_args: list[str] = (),
    timeout_s: float = 900.0,
    name: str | None = None,
    http: bool = False,
) -> ReplicaProcess:
    """Starts a replica and waits until it says SERVING (warm-up and calibration take a while on a CPU). Its data
    directory is workdir/replica-<name> (default: the admission mode). `http`: it serves its HTTP door too
    (`--http-port`), and the wait lasts until that port answers as well."""
    from billing import commands

    # 0700 (narrowed if a run before made it wider: it is ours), so the replica finds its ledger's directory private
    data_dir = private_dir(workdir / f"replica-{name or admission}", narrow_existing=True)
    ledger = f"sqlite:///{data_dir / 'ledger.db'}"
    commands.migrate(ledger)
    key = commands.create_tenant(ledger, f"pulse-{os.getpid()}-{int(time.time())}")
    port, metrics_port = free_port(), free_port()
    http_port = free_port() if http else None
    log_path = data_dir / "replica.log"
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--admission",
        admission,
        "--metrics-port",
        str(metrics_port),
        "--data-dir",
        str(data_dir),
        "--ledger",
        ledger,
        *(["--http-port", str(http_port)] if http_port else []),
        *serve_args,
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    http_url = f"http://127.0.0.1:{http_port}" if http_port else ""
    replica = ReplicaProcess(admission, f"127.0.0.1:{port}", metrics_url, key, log_path, proc, ledger, http_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "zeroqueue: SERVING" in log_path.read_text(errors="replace") and _listening(http_port):
            return replica
        if proc.poll() is not None:
            raise RuntimeError(f"replica ({admission}) exited with {proc.returncode}; see {log_path}")
        time.sleep(0.2)
    replica.stop(grace_s=5)
    raise TimeoutError(f"replica ({admission}) not SERVING after {timeout_s:.0f} s; see {log_path}")
