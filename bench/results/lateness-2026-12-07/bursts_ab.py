"""tests/client/test_sdk_bursts.py's scenario, repeated: on a fresh 4-slot replica of a tiny checkpoint (a
device with a known least step time), 40 calls at once through the SDK, then 40 from plain stubs that never
retry, then 40 through the SDK again; how many of each SDK burst finished in deadline, and admission's lateness
(factor, mean, deviation) after each burst. The unretried burst comes from 40 threads of this process, as the test
sent it until aedd84a, or with --elsewhere from a process of its own (tests/inference/unretried.py, since aedd84a).
Run from a tree's root:

    python bench/results/lateness-2026-12-07/bursts_ab.py [RUNS] [--elsewhere]   # one line per run on stdout
"""

import sys
import tempfile
import threading
from pathlib import Path

import grpc

sys.path.insert(0, str(Path.cwd()))

from zeroqueue.inference.v1 import inference_pb2 as pb  # noqa: E402

from tests.checkpoints import save_hf_checkpoint  # noqa: E402
from tests.client.test_sdk_bursts import sdk_burst  # noqa: E402
from tests.inference.test_overload import start_slow_server, wait_until  # noqa: E402


def unretried_here(server, n: int) -> None:
    """n calls at once from plain stubs on threads of this process, never retried (the test's until aedd84a)."""

    def call() -> None:
        try:
            list(server.stub().Generate(pb.GenerateRequest(prompt="x", max_tokens=16), timeout=3.0))
        except grpc.RpcError:
            pass

    threads = [threading.Thread(target=call) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    runs = int(args[0]) if args else 5
    if "--elsewhere" in sys.argv:
        from tests.inference.unretried import unretried_burst as unretried
    else:
        unretried = unretried_here
    llama_dir = save_hf_checkpoint(Path(tempfile.mkdtemp()), "llama", initializer_range=0.1)
    for r in range(runs):
        server = start_slow_server(llama_dir, max_batch=4)
        try:
            late = server.replica.service.admission.lateness

            def state() -> str:
                return f"{late.factor:.3f}/{late.mean:.3f}/{late.deviation:.3f}"

            first = sdk_burst(server, 40, "first")
            wait_until(lambda: not server.replica.service.in_flight, timeout=10)
            after_first = state()
            unretried(server, 40)
            wait_until(lambda: not server.replica.service.in_flight, timeout=10)
            after_unretried = state()
            second = sdk_burst(server, 40, "second")
            print(f"run {r}: first {first} second {second} lateness {after_first} {after_unretried} {state()}")
            sys.stdout.flush()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
