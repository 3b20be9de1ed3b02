"""What a refusal costs the server's own Python, counted, so that it cannot silently grow again (issue 35).

Under overload most calls are refusals, and each one's CPU is taken from the engine on a small host
(bench/refusal_cost.py measures it in time). A time cannot be asserted in a test; what the refusal path does can:
the Python functions it enters, counted by a profile hook on the replica's event loop thread while one refusal
runs from the handler's entry to the status handed to gRPC (it runs without yielding to the loop: the key is
cached, the prompt short), and the statuses it builds: exactly one, the one it returns.
"""

from __future__ import annotations

import sys
from collections import Counter

import grpc
import pytest
from zeroqueue.inference.v1 import inference_pb2 as pb

from services import status as status_module
from services.inference.device.executor import ExecutorConfig
from services.inference.serve_config import ServeConfig
from tests.inference.harness import ServerThread

# Python functions entered by one refusal for a full replica (slots taken, no retry reserved), counted as below:
# 257 before issue 35 cut the refusal path (a generator-based context manager around the handler, a log line
# scheduled per refusal), 233 after (2026-12-05); 244 on 2026-12-06 (Zen 4), and 251 once admission priced the step
# in flight and each prompt's chunks (7 calls: the step's rows, three calibrated step times a pending prompt).
# Headroom for a small change; a new step on the refusal path (a second status, a log line, a lookup per metric)
# shows here first.
MAX_CALLS_PER_REFUSAL = 256
PROMPT = "def parse_args(argv):\n    result = {}\n"


class RefusalContext:
    """The part of grpc.aio.ServicerContext a refusal touches; abort raises as gRPC's does."""

    def __init__(self, key: str) -> None:
        self.metadata = (("authorization", f"Bearer {key}"),)
        self.statuses: list[grpc.Status] = []

    def invocation_metadata(self) -> tuple:
        return self.metadata

    def time_remaining(self) -> float:
        return 1.0

    async def abort_with_status(self, status: grpc.Status) -> None:
        self.statuses.append(status)
        raise grpc.aio.AbortError()


@pytest.fixture(scope="module")
def full_replica(llama_dir):
    config = ServeConfig(
        str(llama_dir), port=0, executor=ExecutorConfig(max_batch=1, max_seq_len=256), engine_process=False, hold=False
    )
    server = ServerThread(config, step_floor_s=0.05).start()
    metadata = (("authorization", f"Bearer {server.key}"),)
    running = server.stub().Generate(
        pb.GenerateRequest(prompt="def f():", max_tokens=200, temperature=0), timeout=60, metadata=metadata
    )
    next(running)  # admitted: its one slot is taken for the test's length
    yield server
    running.cancel()
    server.stop()


def refuse(server: ServerThread, n: int) -> tuple[list[int], list[Counter], RefusalContext]:
    """n refusals through the servicer's Generate on the replica's loop, each under a profile hook: the Python
    functions each entered, and by name."""
    servicer, context = server.replica.servicer, RefusalContext(server.key)

    async def one(i: int) -> tuple[int, Counter]:
        request = pb.GenerateRequest(prompt=PROMPT, max_tokens=16, temperature=0, request_id=f"refused-{i}")
        names: Counter = Counter()

        def hook(frame, event, arg) -> None:
            if event == "call":
                names[frame.f_code.co_qualname] += 1

        stream = servicer.Generate(request, context)
        sys.setprofile(hook)
        try:
            async for _ in stream:
                raise AssertionError("a call on a full replica was admitted")
        except grpc.aio.AbortError:
            pass
        finally:
            sys.setprofile(None)
        return sum(names.values()), names

    async def all_of_them() -> list[tuple[int, Counter]]:
        return [await one(i) for i in range(n)]

    results = server.run(all_of_them())
    return [count for count, _ in results], [names for _, names in results], context


def test_a_refusal_enters_a_bounded_number_of_functions_and_builds_one_status(full_replica, monkeypatch):
    built = Counter()
    real = status_module.to_grpc_status

    def counting(status):
        built["statuses"] += 1
        return real(status)

    monkeypatch.setattr(status_module, "to_grpc_status", counting)
    refuse(full_replica, 5)  # the first refusals reserve the retry's slot; these after it are the steady state
    built.clear()
    counts, names, context = refuse(full_replica, 20)
    print(f"Python functions entered per refusal: {counts[-1]}", file=sys.stderr)
    assert built["statuses"] == 20, "one status built per refusal, the one it returns"
    assert all(s.code is grpc.StatusCode.RESOURCE_EXHAUSTED for s in context.statuses)
    most = names[counts.index(max(counts))]
    assert max(counts) <= MAX_CALLS_PER_REFUSAL, "\n".join(f"{n} {name}" for name, n in sorted(most.items()))
    # no log line is rendered, or even scheduled, for a refusal for load: the metrics count them
    assert not [name for name in most if "BoundLogger" in name or "call_soon" in name], most


def test_the_counted_refusals_are_real_ones_and_leave_no_trace(full_replica):
    """What the count is of: refusals with their hint and ErrorInfo, that leave nothing in flight."""
    service = full_replica.replica.service
    before = len(service.in_flight)
    _, _, context = refuse(full_replica, 3)
    for status in context.statuses:
        metadata = dict(status.trailing_metadata)
        assert int(metadata["retry-after-ms"]) >= 1 and "x-server-time" in metadata
    assert len(service.in_flight) == before
