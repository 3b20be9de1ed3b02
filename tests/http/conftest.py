"""Replicas with the HTTP door open, for the official SDKs and plain HTTP clients."""

from __future__ import annotations

import time

import httpx
import pytest

from services.inference.bundled_model import BUNDLED_MODEL
from services.inference.device.spec import ExecutorConfig
from services.inference.serve_config import ServeConfig
from tests.checkpoints import save_chatml_checkpoint, save_hf_checkpoint
from tests.inference.harness import ServerThread
from tests.inference.test_usage import outbox_pending

STEP_S = 0.03  # the slow replica's step floor: a call of 20 tokens runs for about 0.6 s


def serve(path, max_batch: int = 8, step_floor_s: float = 0.0, **config) -> ServerThread:
    executor = ExecutorConfig(max_batch=max_batch, max_seq_len=config.pop("max_seq_len", 256))
    cfg = ServeConfig(str(path), port=0, http_port=0, executor=executor, **config)
    return ServerThread(cfg, step_floor_s=step_floor_s).start()


def base_url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.replica.http_port}"


def post(server: ServerThread, path: str, body: dict, key: str | None = None, **headers) -> httpx.Response:
    headers = {"authorization": f"Bearer {key or server.key}", **{k.replace("_", "-"): v for k, v in headers.items()}}
    return httpx.post(base_url(server) + path, json=body, headers=headers, timeout=30)


def wait_until(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def flushed(server: ServerThread) -> None:
    """Every usage record of the replica's finished calls is in its ledger."""
    from pathlib import Path

    wait_until(lambda: outbox_pending(Path(server.config.data_dir)) == 0, timeout=30)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return save_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", initializer_range=0.1)


@pytest.fixture(scope="session")
def chatml_dir(tmp_path_factory):
    return save_chatml_checkpoint(tmp_path_factory.mktemp("chatml"), initializer_range=0.1)


@pytest.fixture(scope="module")
def bundled():
    s = serve(BUNDLED_MODEL, dtype="bfloat16", max_seq_len=512)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def slow(llama_dir):
    """Four slots, steps of at least STEP_S: bursts meet a full replica."""
    s = serve(llama_dir, max_batch=4, step_floor_s=STEP_S)
    yield s
    s.stop()
