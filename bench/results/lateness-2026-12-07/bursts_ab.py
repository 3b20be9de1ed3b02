"""tests/client/test_sdk_bursts.py's scenario, repeated: on a fresh 4-slot replica of a tiny checkpoint (a
device with a known least step time), 40 calls at once through the SDK, then 40 from plain stubs that never
retry, then 40 through the SDK again; how many of each SDK burst finished in deadline, and admission's lateness
(factor, mean, deviation) after each burst. Run from a tree's root:

    python bench/results/lateness-2026-12-07/bursts_ab.py [RUNS]        # one line per run on stdout
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from tests.checkpoints import save_hf_checkpoint  # noqa: E402
from tests.client.test_sdk_bursts import sdk_burst, unretried_burst  # noqa: E402
from tests.inference.test_overload import start_slow_server, wait_until  # noqa: E402


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
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
            unretried_burst(server, 40)
            wait_until(lambda: not server.replica.service.in_flight, timeout=10)
            after_unretried = state()
            second = sdk_burst(server, 40, "second")
            print(f"run {r}: first {first} second {second} lateness {after_first} {after_unretried} {state()}")
            sys.stdout.flush()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
