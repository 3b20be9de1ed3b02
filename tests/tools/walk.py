"""One Generate call, traced: the project's files whose code runs for it, from its arrival at the server to its
row in the ledger, in the order they are first entered. docs/ARCHITECTURE.md's walk lists them, and
tests/tools/test_walk.py keeps the two equal.

Counted: every file under services/ and billing/ one of whose functions is entered while the call is in flight,
on any thread of the replica. The replica runs its engine on a thread (`--engine-thread`), so one profiler sees the
server and the engine; the default engine child adds the pipe's files, which docs/ARCHITECTURE.md names apart.
Not counted, as nano-vllm's count of its step leaves out its layers: the SDK's side of the call, and the model's own
arithmetic below the executor (device/ other than executor.py: the layers, the kernels, the sampler).

    python -m tests.tools.walk            # prints the files, one a line; the count goes to stderr
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[2]
COUNTED = ("services/", "billing/")
SDK = "services/client/"  # the caller's side, in this process only because the walk calls itself
BELOW_THE_EXECUTOR = "services/inference/device/"
EXECUTOR = "services/inference/device/executor.py"


def counted(path: str) -> str | None:
    """`path` relative to the repository when it is a file the walk counts, else None."""
    try:
        relative = Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None
    if not relative.startswith(COUNTED) or relative.startswith(SDK):
        return None
    if relative.startswith(BELOW_THE_EXECUTOR) and relative != EXECUTOR:
        return None
    return relative


class Tracer:
    """A profile hook on every thread, started before the replica so that its threads carry it; it records only
    while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.files: dict[str, None] = {}  # in the order first entered
        self._known: dict[str, str | None] = {}

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if not self.on or event != "call":
            return
        filename = frame.f_code.co_filename
        if filename not in self._known:
            self._known[filename] = counted(filename)
        relative = self._known[filename]
        if relative is not None and relative not in self.files:
            self.files[relative] = None

    def install(self) -> None:
        threading.setprofile(self)
        sys.setprofile(self)

    def remove(self) -> None:
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.setprofile(None)


def _wait(until: Callable[[], bool], timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > end:
            raise TimeoutError("the call's usage record never reached the ledger")
        time.sleep(0.01)


def walk(model_dir: str | Path) -> list[str]:
    """The files one Generate of a few tokens crosses on a fresh replica of `model_dir`, after one call has warmed
    every path (so that nothing first-time, such as a cache fill, is counted)."""
    from zeroqueue.inference.v1 import inference_pb2 as pb

    from services.inference.serve_config import ServeConfig
    from tests.inference.harness import ServerThread

    tracer = Tracer()
    tracer.install()
    config = ServeConfig(
        model_dir=str(model_dir), port=0, engine_process=False, policy_refresh_s=3600.0, data_dir=tempfile.mkdtemp()
    )
    server = ServerThread(config).start()
    try:
        ledger = server.config.ledger_url.removeprefix("sqlite:///")

        def num_records() -> int:
            with sqlite3.connect(ledger) as db:
                return db.execute("SELECT count(*) FROM usage_records").fetchone()[0]

        stub = server.stub()
        list(stub.Generate(pb.GenerateRequest(prompt="def add(a, b):", max_tokens=2), timeout=60))
        _wait(lambda: num_records() == 1)
        tracer.on = True
        list(stub.Generate(pb.GenerateRequest(prompt="class Point:", max_tokens=4), timeout=60))
        _wait(lambda: num_records() == 2)
        tracer.on = False
    finally:
        tracer.remove()
        server.stop()
    return list(tracer.files)


def main() -> None:
    from services.logs import configure_logging
    from tests.checkpoints import save_hf_checkpoint

    configure_logging()

    model_dir = save_hf_checkpoint(Path(tempfile.mkdtemp(prefix="walk-")), "llama")
    files = walk(model_dir)
    print("\n".join(files))
    print(f"{len(files)} files", file=sys.stderr)


if __name__ == "__main__":
    main()
