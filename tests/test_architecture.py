"""The layer order of the package, written down once, and a walk of its imports that fails on a cycle or an
import against that order.

Every import counts, wherever it is written (module level, inside a function, under TYPE_CHECKING): a lazy
import that dodges a cycle at run time is still a dependency of the design.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "geserve"

# Top to bottom: a module may import its own layer and the layers below it, never one above. The longest
# matching prefix places a module. A new protocol goes in frontends/, a new scheduler kind in scheduling/, a new
# backend in backends/ (each registers itself in its package's registry).
LAYERS: tuple[tuple[str, ...], ...] = (
    # the composition root: builds everything from settings and starts the frontends
    ("geserve", "geserve.__main__", "geserve.cli", "geserve.server",
     "geserve.integrations",  # other hosts of the same core (Ray Serve): composition roots too
     "geserve.workers"),  # the supervisor of --workers N and each worker's link to it
    # tools that drive a server from outside (`geserve tune` starts one and measures it with perf_analyzer)
    ("geserve.tune",),
    # wire <-> core types, nothing else
    ("geserve.frontends",),
    # the one front door: every call, any protocol; the scrape-time collector reads models the same way
    ("geserve.service", "geserve.metrics.collector"),
    # what exists on disk, load / unload, the dependency graph, the builder of a loaded model
    ("geserve.repository",),
    # queue policies, batch forming, instance pools, ensembles
    ("geserve.scheduling",),
    # ModelInstance implementations (GE, Python, ensemble) and their registry
    ("geserve.backends",),
    # execution providers; the offline compiler (never imports serving code)
    ("geserve.devices", "geserve.compiler"),
    # leaves: imported by all, import nothing above them
    (
        "geserve.types",
        "geserve.arrivals",
        "geserve.config",
        "geserve.errors",
        "geserve.statistics",
        "geserve.settings",
        "geserve.version",
        "geserve.metrics",
    ),
)


# Frontends reach the models only through the service: below it they may import the leaves only.
THROUGH_THE_SERVICE = ("geserve.frontends",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported geserve module, line) for each import in the file; `from pkg import mod` names the module."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("geserve"):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if not target.startswith("geserve"):
                continue
            for alias in node.names:
                child = f"{target}.{alias.name}"
                yield (child if child in modules else target), node.lineno


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "geserve" and module.startswith(prefix + "."))
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def import_graph() -> dict[str, list[tuple[str, int]]]:
    modules = all_modules()
    return {name: sorted(set(imports_of(name, path, modules))) for name, path in modules.items()}


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in all_modules() if layer_of(m) < 0]
    assert not unplaced, f"modules outside every layer (add them to LAYERS): {unplaced}"


def test_imports_follow_the_layer_order() -> None:
    service, leaves = layer_of("geserve.service"), len(LAYERS) - 1
    violations = []
    for module, imported in import_graph().items():
        for target, line in imported:
            if target == "geserve" and module != "geserve":
                violations.append(f"{module}:{line} imports the package root (import the module itself)")
            elif layer_of(target) < layer_of(module):
                violations.append(
                    f"{module}:{line} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)}), "
                    f"a layer above it"
                )
            elif module.startswith(THROUGH_THE_SERVICE) and service < layer_of(target) < leaves:
                violations.append(f"{module}:{line} imports {target}, past the service")
    assert not violations, "imports against the layer order:\n  " + "\n  ".join(violations)


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One import cycle of `graph`, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in graph:
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_no_import_cycles() -> None:
    # A package's __init__ re-exporting its modules is how a package presents itself, not a dependency back:
    # a module importing its own package's __init__ is not followed.
    graph = {
        module: [t for t, _ in imported if not module.startswith(t + ".")]
        for module, imported in import_graph().items()
    }
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("graph", "has_cycle"),
    [
        ({"a": ["b"], "b": ["c"], "c": []}, False),
        ({"a": ["b"], "b": ["c"], "c": ["a"]}, True),
        ({"a": ["a"]}, True),
    ],
)
def test_the_cycle_finder_finds_cycles(graph: dict[str, list[str]], has_cycle: bool) -> None:
    assert (find_cycle(graph) is not None) is has_cycle


def test_the_layer_check_sees_an_upward_import() -> None:
    assert layer_of("geserve.frontends.http.app") < layer_of("geserve.service.inference")
    assert layer_of("geserve.metrics.collector") < layer_of("geserve.metrics.custom")
    assert layer_of("geserve.scheduling.pool") < layer_of("geserve.statistics")
