"""What bench/gpu_check.py can import, traced: the third-party distributions behind it and where they load from.

    python bench/gpu_imports.py    # one line per distribution: name, version, the folder it was imported from

gpu_run.sh writes this into env.txt on the device, so a run shows whether the carried grpcio and protobuf won
over the image's; tests/bench/test_gpu_run.py checks with trace() that each distribution is in the H200 image
(bench/gpu_image_packages.txt) or carried (bench/gpu_wheels.txt).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Whole packages, not gpu_check's current imports: the script changes often, and its pulse part may run the
# service in-process (server, billing, migrations). The modules are the ones gpu_check and nvml.py import
# inside functions, which importing the packages does not reach.
PACKAGES = ("services.inference", "billing", "zeroqueue")
MODULES = ("services.errors", "services.logs", "safetensors.torch", "tokenizers", "pynvml")
OWN = "zeroqueue"  # our own distribution (installed editable here): on the device it is the working tree


def entry_modules() -> list[str]:
    names = list(MODULES)
    for package in PACKAGES:
        path = importlib.import_module(package).__path__
        names += [package] + [
            m.name for m in pkgutil.walk_packages(path, package + ".") if not m.name.endswith("__main__")
        ]  # kernels/__main__ would build the kernels
    return names


def trace() -> dict[str, list[str]]:
    """Imports every entry module; returns each third-party top-level module it pulled in, with the
    distributions that provide it (several for a namespace such as google: protobuf and googleapis)."""
    sys.path[:0] = [str(ROOT), str(ROOT / "protos")]
    before = set(sys.modules)
    for name in entry_modules():
        importlib.import_module(name)
    owners = importlib.metadata.packages_distributions()
    tops = {name.partition(".")[0] for name in set(sys.modules) - before}
    return {top: sorted(set(owners[top]) - {OWN}) for top in sorted(tops) if set(owners.get(top, [OWN])) - {OWN}}


def main() -> None:
    for top, dists in trace().items():
        where = getattr(sys.modules[top], "__file__", None) or list(getattr(sys.modules[top], "__path__", []))
        for dist in dists:
            print(f"{dist:28} {importlib.metadata.version(dist):14} {top}: {where}")


if __name__ == "__main__":
    main()
