"""What services/pulse and the SDK may import, read from their source: pulse's modules form no cycle, no module
imports another's private (underscore) names, and the SDK reaches only grpc, protobuf, the generated stubs and
the standard library, so that its wheel (test_client_wheel.py) installs without the server or torch."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import services.client
import services.pulse

PULSE = Path(services.pulse.__file__).parent
SDK = Path(services.client.__file__).parent
# what the SDK may import beyond the standard library and itself: grpcio, protobuf and googleapis-common-protos
# (google.protobuf, google.rpc), the stubs; the client wheel's dependencies say the same
SDK_MAY_IMPORT = {"grpc", "google", "zeroqueue"}


def imports(path: Path, package: str) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every import in the file, nested ones too, made absolute."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            out.append((module, [alias.name for alias in node.names]))
    return out


def test_pulse_has_no_import_cycle():
    graph = {p.stem: set() for p in PULSE.glob("*.py")}
    for path in PULSE.glob("*.py"):
        for module, names in imports(path, "services.pulse"):
            if module == "services.pulse":
                graph[path.stem] |= {n for n in names if n in graph}
            elif module.startswith("services.pulse."):
                graph[path.stem].add(module.split(".")[2])
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"import cycle: {' -> '.join((*path, node))}"
        if node not in done:
            for nxt in sorted(graph[node]):
                visit(nxt, (*path, node))
            done.add(node)

    for node in sorted(graph):
        visit(node, ())


def test_no_private_names_cross_modules():
    for root, package in ((PULSE, "services.pulse"), (SDK, "services.client")):
        for path in root.glob("*.py"):
            for module, names in imports(path, package):
                private = [n for n in names if n.startswith("_") and module != "__future__"]
                assert not private, f"{path.name} imports {private} from {module}"


def test_sdk_imports_only_grpc_protobuf_and_the_stubs():
    for path in SDK.glob("*.py"):
        for module, _ in imports(path, "services.client"):
            top = module.split(".")[0]
            if module.startswith("services.client") or top in sys.stdlib_module_names:
                continue
            assert top in SDK_MAY_IMPORT, f"the SDK's {path.name} imports {module}"
