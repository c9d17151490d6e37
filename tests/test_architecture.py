"""The layer order of the package, written down once, and a walk of its imports that fails on a cycle or an
import against that order.

Every import counts, wherever it is written (module level, inside a function, under TYPE_CHECKING): a lazy
import that dodges a cycle at run time is still a dependency of the design. Cycles are forbidden between modules
and between packages: two packages that import each other, even through modules that do not, are one package in
two folders (compiler <-> devices was, through the TensorRT engine cache's keys, until those moved to the
`geserve.cachekeys` leaf).

A request travels one pipeline, whatever its protocol or shortcut (PIPELINE_STAGES, in order): a frontend decodes
and encodes, the service does everything between, and a fast path is a stage remembered or skipped inside it,
never a second pipeline beside it.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
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
        "geserve.cachekeys",
        "geserve.statistics",
        "geserve.settings",
        "geserve.version",
        "geserve.metrics",
        "geserve.ipc",  # calls between the server's processes (workers, a Python model's own process)
    ),
)


# Frontends reach the models only through the service: below it they may import the leaves only.
THROUGH_THE_SERVICE = ("geserve.frontends",)

# The stages of every request, in order, and who owns each. A remembered JSON header is a cached result of decode +
# resolve + prepare (keyed by its bytes and the model's load generation); answering in the read callback is how
# submit runs a model that may run on the loop; both stay stages of this one pipeline.
PIPELINE_STAGES: tuple[tuple[str, str], ...] = (
    ("decode", "geserve.frontends: wire bytes -> an InferenceRequest and its call context"),
    ("admit", "geserve.service: authorization by API group, restrictions, size and rate limits"),
    ("resolve model", "geserve.service: name and version -> the loaded model (its load generation)"),
    ("validate / prepare", "geserve.service: parameters, shapes, byte sizes, shared memory -> arrays"),
    ("submit", "geserve.scheduling: direct | dynamic batcher | sequence batcher | ensemble"),
    ("account", "geserve.service: one record of the outcome (success, each failure, cancel, cache hit)"),
    ("encode", "geserve.frontends: the response or the error -> wire bytes, one error table per protocol"),
)


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


def package_of(module: str, modules: dict[str, Path]) -> str:
    """The package a module belongs to: its folder, or the module itself where LAYERS places it apart from its
    folder (metrics.collector sits in the service layer, the rest of metrics among the leaves)."""
    folder = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
    placed = max((p for layer in LAYERS for p in layer if module == p or module.startswith(p + ".")), key=len,
                 default=folder)
    return placed if len(placed) > len(folder) else folder


def package_graph(graph: dict[str, list[str]], package: Callable[[str], str]) -> dict[str, list[str]]:
    """`graph` between packages. An import between a package and one inside it (a package's registry importing its
    members, a member importing its package's shared module) stays inside the package, as the module check sees."""
    edges: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = package(module)
        for target in map(package, targets):
            if not (source == target or source.startswith(target + ".") or target.startswith(source + ".")):
                edges.setdefault(source, set()).add(target)
    return {source: sorted(targets) for source, targets in edges.items()}


def test_no_package_import_cycles() -> None:
    modules = all_modules()
    graph = {module: [t for t, _ in imported] for module, imported in import_graph().items()}
    cycle = find_cycle(package_graph(graph, lambda m: package_of(m, modules)))
    assert cycle is None, "package import cycle: " + " -> ".join(cycle or [])


def test_the_package_check_sees_a_cycle_no_module_closes() -> None:
    # The cycle this check was written for: no module imports back a module that imports it, yet the packages do.
    graph = {
        "geserve.compiler.command": ["geserve.devices.tensorrt"],
        "geserve.devices.tensorrt": ["geserve.compiler.cache"],
        "geserve.compiler.cache": [],
    }
    assert find_cycle(graph) is None
    folder = {m: m.rpartition(".")[0] for m in graph}
    assert find_cycle(package_graph(graph, folder.__getitem__)) is not None


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


# The service's ways into an inference. `submit` is the one entry (every step, every shortcut inside it); `infer`
# is `submit` awaited, and `infer_stream` streams a decoupled model's responses (any other model's one response is
# `submit`'s). A frontend may use only these: anything else would be a second door beside the one path.
INFERENCE_ENTRIES = {"submit", "infer", "infer_stream"}
SERVICE_PATH = PACKAGE_ROOT / "service" / "service.py"


def service_methods() -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(SERVICE_PATH.read_text(), str(SERVICE_PATH))
    (service,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "InferenceService"]
    return {n.name: n for n in service.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def calls_on_service(path: Path) -> set[str]:
    """The attributes a module calls on the service (`self._service.x(...)`, `service.x(...)`)."""
    called = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("_service", "service"):
                called.add(node.func.attr)
    return called


def test_the_service_has_one_entry_for_an_inference() -> None:
    methods = service_methods()
    entries = {name for name in methods if not name.startswith("_") and (
        name.startswith(("infer", "submit", "answer", "run")) or "now" in name or "soon" in name)}
    assert entries - {"run_forwarded", "run_control"} == INFERENCE_ENTRIES
    # `infer` is `submit` awaited, and `infer_stream` hands a model that is not decoupled to `infer`.
    for name, delegate in (("infer", "submit"), ("infer_stream", "infer")):
        called = {n.func.attr for n in ast.walk(methods[name])
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        assert delegate in called, f"InferenceService.{name} does not go through {delegate}"


def test_a_frontend_reaches_inference_only_through_the_entry() -> None:
    public = {name for name in service_methods() if not name.startswith("_")}
    inference_like = {name for name in public if name.startswith(("infer", "submit", "prepare", "model_now"))}
    for path in sorted((PACKAGE_ROOT / "frontends").rglob("*.py")):
        used = calls_on_service(path) & (inference_like | {"infer_now", "infer_soon", "infer_prepared_now"})
        assert used <= INFERENCE_ENTRIES, f"{path.relative_to(PACKAGE_ROOT)} calls {sorted(used - INFERENCE_ENTRIES)}"


def test_openai_embeddings_infer_through_the_entry() -> None:
    # OpenAI's /v1/embeddings (service/embeddings.py) turns a call into inference requests: each goes through the
    # service's `infer`, as a frontend's would, and nothing there reaches a model's scheduler or instances.
    path = PACKAGE_ROOT / "service" / "embeddings.py"
    tree = ast.parse(path.read_text(), str(path))
    on_door = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "_door"}
    assert on_door == {"admit", "admit_ahead", "infer"}, on_door
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not attributes & {"scheduler", "enqueue", "schedule", "run_now", "execute"}, attributes
