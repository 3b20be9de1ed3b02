"""`zeroqueue health`, the command the image's HEALTHCHECK runs: exit 1 while the replica warms up, 0 once it
serves, 2 when nothing answers; the `liveness` name says SERVING throughout (what the livenessProbe asks)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from services.inference.device.executor import Executor, ExecutorConfig
from services.inference.replica import Replica
from services.inference.serve_config import ServeConfig
from tests.checkpoints import save_hf_checkpoint
from tests.inference.harness import ServerThread

ROOT = Path(__file__).resolve().parents[2]


class GatedServer(ServerThread):
    """A replica whose warm-up waits for `gate`, so the test sees it warming up for as long as it needs."""

    def __init__(self, config: ServeConfig, gate: threading.Event) -> None:
        super().__init__(config)
        self.gate = gate

    async def _make_replica(self) -> Replica:
        def make_executor(*args, **kwargs) -> Executor:
            assert self.gate.wait(120), "the test never opened the gate"
            return Executor(*args, **kwargs)

        return Replica(self.config, make_executor=make_executor)


def health(address: str, *service: str) -> subprocess.CompletedProcess:
    args = ["--service", *service] if service else []
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "health", "--address", address, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_exit_codes_follow_the_replica_through_warm_up_serving_and_stop(tmp_path: Path) -> None:
    model = save_hf_checkpoint(tmp_path / "llama", "llama", initializer_range=0.1)
    gate = threading.Event()
    # the engine on a thread here, so the gate (an event in this process) can hold its warm-up
    config = ServeConfig(
        str(model), port=0, engine_process=False, executor=ExecutorConfig(max_batch=2, max_seq_len=128)
    )
    server = GatedServer(config, gate).start(wait_ready=False)
    try:
        warming = health(server.address)
        assert (warming.returncode, warming.stdout.split()[-1]) == (1, "NOT_SERVING")
        assert health(server.address, "liveness").returncode == 0
        gate.set()
        server.port = server.started.result(timeout=120)
        serving = health(server.address)
        assert (serving.returncode, serving.stdout.split()[-1]) == (0, "SERVING")
        assert health(server.address, "").returncode == 0
        assert health(server.address, "no.such.Service").returncode == 2  # NOT_FOUND: not a healthy answer
    finally:
        gate.set()
        server.stop()
    stopped = health(server.address)
    assert stopped.returncode == 2 and "UNAVAILABLE" in stopped.stderr
