"""What services/, billing/, bench/ and the SDK may import, read from their source: no import cycle anywhere in
services/, billing/ and bench/; no pulse or SDK module imports another's private (underscore) names; and the SDK
reaches only grpc, protobuf, the generated stubs and the standard library, so that its wheel
(test_client_wheel.py) installs without the server or torch."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import services.client
import services.pulse

PULSE = Path(services.pulse.__file__).parent
ROOT = Path(services.pulse.__file__).resolve().parents[2]
TREES = ("services", "billing", "bench")
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


def module_name(path: Path) -> str:
    """services/inference/engine/core.py -> services.inference.engine.core; a package's __init__.py -> the package;
    a bench script -> bench.<stem> (bench/ runs its scripts with bench/ on sys.path, so they import by stem)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of services/, billing/ and bench/ it imports: every import, inside functions and under
    TYPE_CHECKING too (a cycle hidden in a function is still a cycle), to the exact module named (not the parent
    packages Python imports on the way, which are initialised first and form no cycle)."""
    paths = {
        module_name(path): path for tree in TREES for path in (ROOT / tree).rglob("*.py") if "_build" not in path.parts
    }
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for module, names in imports(path, package):
            if name.startswith("bench.") and f"bench.{module}" in graph:
                module = f"bench.{module}"  # a bench script importing its neighbour by stem
            submodules = {f"{module}.{n}" for n in names} & graph.keys()
            graph[name] |= submodules or ({module} & graph.keys())
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            if cycle := visit(nxt, [*path, node]):
                return cycle
        done.add(node)
        return None

    return next((cycle for node in sorted(graph) if (cycle := visit(node, []))), None)


def test_services_billing_and_bench_have_no_import_cycle():
    graph = import_graph()
    assert "services.cli" in graph and "billing.commands" in graph and "bench.soak" in graph  # it reads the tree
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_cycle_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


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
