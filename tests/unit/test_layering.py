"""The package layering holds: lower layers never import higher ones, no cycles, no private reach.

Layers, lowest first: the routing core; the wire and the client (the root
package `geofed`, `geofed.client`, `geofed.wire`, `geofed.errors`); the
broker node; the tools (CLI, benchmarks and the Spark analysis, the
Kubernetes renderer). Generated protobuf code (`geofed.v1`) and the bundled
federation data may be used by any layer. The check reads the sources'
import statements (also those inside functions), so it needs no optional
dependency.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAYERS = {
    "geofed.routing": 0,
    "geofed": 1,
    "geofed.client": 1,
    "geofed.wire": 1,
    "geofed.errors": 1,
    "geofed.node": 2,
    "geofed.cli": 3,
    "geofed.bench": 3,
    "geofed.k8s": 3,
}
ANY_LAYER = ("geofed.v1", "geofed.federations")


def _modules() -> dict[str, Path]:
    """Module name -> source file, from pyproject's package map."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs: dict[str, str] = setup["package-dir"]
    out: dict[str, Path] = {}
    for package in setup["packages"]:
        folder = ROOT / dirs[package]
        for path in folder.glob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out[name] = path
    return out


MODULES = _modules()


def _targets(node: ast.stmt | ast.expr, package: str) -> list[str]:
    """The modules or names an import statement imports ([] for any other node)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        return [f"{module}.{alias.name}" for alias in node.names]
    return []


def _package_of(name: str, path: Path) -> str:
    return name if path.stem == "__init__" else name.rpartition(".")[0]


def _imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module or name, line) of every import in a module, nested ones included."""
    package = _package_of(name, path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        for target in _targets(node, package):  # type: ignore[arg-type]  # any AST node
            yield target, getattr(node, "lineno", 0)


def _resolve(target: str) -> str | None:
    """The geofed module an imported name lives in (longest known prefix)."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in MODULES:
            return candidate
    return None


def _layer(module: str) -> int | None:
    if module.startswith(ANY_LAYER):
        return None
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def _package(module: str) -> str:
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)


def test_the_tree_is_what_the_layering_knows() -> None:
    assert "geofed" in MODULES and "geofed.node" in MODULES and "geofed.wire" in MODULES
    for module in MODULES:
        assert module.startswith(ANY_LAYER) or _layer(module) is not None, module


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_goes_up_a_layer_or_into_another_package_private_module(module: str) -> None:
    if module.startswith(ANY_LAYER):
        return
    mine = _layer(module)
    assert mine is not None
    for target, line in _imports(module, MODULES[module]):
        if not target.startswith("geofed"):
            continue
        found = _resolve(target)
        assert found is not None, f"{module}:{line} imports unknown {target}"
        theirs = _layer(found)
        if theirs is None:
            continue
        assert theirs <= mine, f"{module}:{line} imports {target} from a higher layer"
        private = any(part.startswith("_") for part in found.split(".")[1:])
        if private and _package(found) != _package(module):
            pytest.fail(f"{module}:{line} imports {target}, private to {_package(found)}")


def test_no_import_cycles_at_module_level() -> None:
    """Imports executed when a module loads form no cycle (deferred imports may)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        package = _package_of(module, path)
        deps: set[str] = set()
        for node in ast.parse(path.read_text(), str(path)).body:  # module level only
            for target in _targets(node, package):
                found = _resolve(target)
                if found and found != module:
                    deps.add(found)
        graph[module] = deps
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycle = [*stack[stack.index(d) :], d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
