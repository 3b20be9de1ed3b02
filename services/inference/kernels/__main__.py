"""`python -m services.inference.kernels build`: compile the CPU kernels ahead of time (make install runs it)."""
from __future__ import annotations

import argparse
import sys
import time

from . import BUILD_DIR, COMPILE_FLAGS, REQUIRED_CPU_FLAGS, SOURCES, load_cpu_ops, missing_cpu_flags, reason_unavailable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.inference.kernels")
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--strict", action="store_true", help="exit 1 when the kernels are unavailable")
    args = parser.parse_args(argv)
    missing = missing_cpu_flags()
    print(f"cpu: needs {' '.join(REQUIRED_CPU_FLAGS)}; "
          + (f"missing {' '.join(missing)}" if missing else "all present"))
    started = time.monotonic()
    ops = load_cpu_ops()
    if ops is None:
        # Not an install failure: the engine falls back to plain torch and logs the same reason.
        print(f"kernels unavailable: {reason_unavailable()}")
        return 1 if args.strict else 0
    print(f"built {', '.join(path.name for path in SOURCES)} -> {ops.library_path} "
          f"in {time.monotonic() - started:.1f} s")
    print(f"flags: {' '.join(COMPILE_FLAGS)}; build dir {BUILD_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
