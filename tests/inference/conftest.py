from __future__ import annotations

import queue
import time
from collections import defaultdict

import pytest

from services.inference.device.executor import Executor, ExecutorConfig
from services.inference.device.loader import load_checkpoint
from services.inference.engine.engine import Engine, RequestOutput
from services.inference.sched.request import Request, SamplingParams
from tests.checkpoints import save_chatml_checkpoint, save_hf_checkpoint


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return save_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", initializer_range=0.1)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    return save_hf_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", initializer_range=0.1)


@pytest.fixture(scope="session")
def chatml_dir(tmp_path_factory):
    """A random llama with a ChatML chat template (tests/checkpoints.py): chat calls are served on it."""
    return save_chatml_checkpoint(tmp_path_factory.mktemp("chatml"), initializer_range=0.1)


def make_engine(path, dtype="float32", max_num_batched_tokens=256, **config) -> Engine:
    checkpoint = load_checkpoint(path, dtype=dtype)
    config.setdefault("max_seq_len", 256)
    executor = Executor(checkpoint, ExecutorConfig(**config))
    return Engine(
        executor, checkpoint.tokenizer, checkpoint.eos_token_ids, max_num_batched_tokens=max_num_batched_tokens
    )


def request(call_id: str, prompt: list[int], deadline_ns: int | None = None, **sampling) -> Request:
    sampling.setdefault("temperature", 0.0)
    return Request(call_id, tuple(prompt), SamplingParams(**sampling), time.monotonic_ns(), deadline_ns)


class Collector:
    """An output sink that keeps every output per request."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[RequestOutput]] = defaultdict(list)
        self.queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def put(self, output: RequestOutput) -> None:
        self.outputs[output.call_id].append(output)

    def tokens(self, call_id: str) -> list[int]:
        return [t for o in self.outputs[call_id] for t in o.token_ids]

    def text(self, call_id: str) -> str:
        return "".join(o.text for o in self.outputs[call_id])

    def finish_reason(self, call_id: str) -> str | None:
        return self.outputs[call_id][-1].finish_reason if self.outputs[call_id] else None


def run_to_completion(engine: Engine, max_steps: int = 10_000) -> int:
    steps = 0
    while engine.has_work and steps < max_steps:
        engine.step()
        steps += 1
    assert not engine.has_work, "engine did not finish"
    return steps
