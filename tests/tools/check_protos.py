"""Regenerates the protobuf/gRPC code into a scratch folder and fails if the committed code differs.

`make protos` is the one command that writes the generated files; this check keeps them honest.
"""

from __future__ import annotations

import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[str]:
    return sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))


def stale_files() -> list[str]:
    with tempfile.TemporaryDirectory() as out:
        include = str(Path(protoc.__file__).parent / "_proto")
        args = [
            "protoc",
            f"-I{PROTOS}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--pyi_out={out}",
            *proto_files(),
        ]
        if protoc.main(args) != 0:
            return ["protoc failed"]
        generated = {p.relative_to(out) for p in Path(out).rglob("*") if p.name.endswith(SUFFIXES)}
        committed = {p.relative_to(PROTOS) for p in PROTOS.rglob("*") if p.name.endswith(SUFFIXES)}
        stale = sorted(str(p) for p in generated ^ committed)
        stale += sorted(
            str(p) for p in generated & committed if not filecmp.cmp(Path(out) / p, PROTOS / p, shallow=False)
        )
        return stale


def main() -> int:
    stale = stale_files()
    if stale:
        print("generated protobuf code is stale; run `make protos` and commit:", *stale, sep="\n  ")
        return 1
    print(f"generated protobuf code is fresh ({len(proto_files())} .proto files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
