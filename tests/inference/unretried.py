"""A burst of calls from plain stubs that never come back for their reservations, sent from a process of its own.

The replicas of these tests run their engine on a thread of the test's process (so a test can slow its device);
40 client threads in that process took the GIL from it, and the burst's admitted calls ran 1.15-1.3 times their
prediction: lateness a replica with its engine in a child process would never see, carried into the next burst
(BENCHMARKS.md, "Lateness learnt only from calls that ran all their tokens").

    python -m tests.inference.unretried ADDRESS KEY N MAX_TOKENS TIMEOUT_S    # stdout: how many were served
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import grpc
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def unretried_burst(server, n: int, max_tokens: int = 16, timeout_s: float = 3.0) -> int:
    """n calls at once into `server` (a ServerThread) from another process; how many were served."""
    args = [server.address, server.key, str(n), str(max_tokens), str(timeout_s)]
    done = subprocess.run(
        [sys.executable, "-m", "tests.inference.unretried", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return int(done.stdout.strip())


def main() -> None:
    address, key = sys.argv[1:3]
    n, max_tokens, timeout_s = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(address))
    metadata, served = (("authorization", f"Bearer {key}"),), []

    def call(i: int) -> None:
        try:
            request = pb.GenerateRequest(prompt="x", max_tokens=max_tokens)
            list(stub.Generate(request, timeout=timeout_s, metadata=metadata))
            served.append(i)
        except grpc.RpcError:
            pass

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    print(len(served))


if __name__ == "__main__":
    main()
