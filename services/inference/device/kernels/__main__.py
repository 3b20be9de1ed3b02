"""`python -m services.inference.device.kernels build`: compile the CPU kernels ahead of time (make install runs it).
It builds the one ISA's variant this CPU loads (see ISAS); the other is built where it runs."""

from __future__ import annotations

import argparse
import sys
import time

from . import ISAS, SOURCES, isa_named, load_cpu_ops, missing_cpu_flags, reason_unavailable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.inference.device.kernels")
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--strict", action="store_true", help="exit 1 when the kernels are unavailable")
    args = parser.parse_args(argv)
    for isa in ISAS:
        missing = missing_cpu_flags(required=isa.cpu_flags)
        print(
            f"cpu: {isa.name} needs {' '.join(isa.cpu_flags)}; "
            + (f"missing {' '.join(missing)}" if missing else "all present")
        )
    started = time.monotonic()
    ops = load_cpu_ops()
    if ops is None:
        # Not an install failure: the engine falls back to plain torch and logs the same reason.
        print(f"kernels unavailable: {reason_unavailable()}")
        return 1 if args.strict else 0
    isa = isa_named(ops.isa)
    print(
        f"built {', '.join(path.name for path in SOURCES)} -> {ops.library_path} in {time.monotonic() - started:.1f} s"
    )
    print(f"isa {ops.isa}, flags: {' '.join(isa.compile_flags)}; build dir {isa.build_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
