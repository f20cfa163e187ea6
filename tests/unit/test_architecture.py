"""The package's layers (docs/ARCHITECTURE.md): a module imports only from its own layer or below, and no
modules import each other in a cycle. Every import counts: module level, inside functions and under
TYPE_CHECKING alike (a lazy import is still a dependency, and a cycle hidden in a function is still one)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvsidecar"

# Lowest first. Each top-level module or subpackage of kvsidecar is in exactly one layer; a module named
# here (`api.bodies`) is a unit of its own, in its own layer. ARCHITECTURE.md draws the same table.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kvsidecar", "errors", "logs", "metrics", "buildcheck", "defaults", "units"),  # base: no domain
    ("config", "files", "backend", "client"),  # the config; touching files; llama-server's API; hook client
    (
        "fingerprint",
    ),  # runtime identity: what the running llama-server is, and what a snapshot was saved under
    ("store",),  # snapshots and their manifests on disk
    ("coordinator", "retention"),  # the decisions: slots, sessions, restore/save/erase; what to delete
    ("http", "api.bodies"),  # the HTTP machinery; the hook API's request bodies (fleet mode queues them)
    (
        "api",
        "proxy",
        "fleet",
        "doctor",
    ),  # adapters: hook API, the llama-server-compatible proxy, fleet, checks
    ("daemon", "cli", "demo", "testing", "__main__"),  # composition roots: the daemon, the command, test rigs
)
_IMPORTERS = {"import_module", "__import__"}  # importlib.import_module("kvsidecar.x") is an import too


def modules_of(package: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(modules: dict[str, Path], name: str) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _named(node: ast.AST, package: str, modules: dict[str, Path]) -> list[str]:
    """The modules one AST node imports: `import`, `from ... import` (relative too), or a call of
    importlib.import_module / __import__ with a literal name."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in _IMPORTERS and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    return []


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its text."""
    modules = modules_of(package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            for name in _named(node, pkg, modules):
                target = _resolve(modules, name)
                if target is not None and target != module:
                    targets.add(target)
        graph[module] = targets
    return graph


MODULES = modules_of(PACKAGE)
GRAPH = import_graph(PACKAGE)


def unit_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> tuple[str, int]:
    """The layer member a module belongs to (the longest one naming it or a package above it) and its layer."""
    parts = module.split(".")[1:] or [module]
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        for index, members in enumerate(layers):
            if name in members:
                return name, index
    raise AssertionError(f"{module} is in no layer: add `{parts[0]}` to LAYERS and to docs/ARCHITECTURE.md")


def layer_of(module: str) -> int:
    return unit_of(module)[1]


def upward_imports(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    return sorted(
        f"{module} (layer {unit_of(module, layers)[1]}) imports {target} (layer {unit_of(target, layers)[1]})"
        for module, targets in graph.items()
        for target in targets
        if unit_of(target, layers)[1] > unit_of(module, layers)[1]
    )


def unit_graph(
    graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS
) -> dict[str, set[str]]:
    """The same imports between layer members (subpackages, top-level modules, named modules)."""
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        unit = unit_of(module, layers)[0]
        units.setdefault(unit, set()).update(
            unit_of(t, layers)[0] for t in targets if unit_of(t, layers)[0] != unit
        )
    return units


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_no_module_imports_a_higher_layer() -> None:
    assert upward_imports(GRAPH) == []


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one member (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    assert strongly_connected(GRAPH) == []


def test_no_cycles_between_subpackages() -> None:
    """Within a layer too, two subpackages never import each other (the store and the fingerprint, say):
    each concern can be read, and changed, from the bottom up."""
    assert strongly_connected(unit_graph(GRAPH)) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert strongly_connected(graph) == expected


def test_the_checks_see_every_way_a_module_imports_another(tmp_path: Path) -> None:
    """On a package made for the purpose: an upward import written relatively, a lazy one, one under
    TYPE_CHECKING and one through importlib are all seen, and so are a module cycle and a unit cycle."""
    pkg = tmp_path / "kvsidecar"
    files = {
        "__init__.py": "",
        "errors.py": "from .daemon import service\n",  # relative, upward
        "logs.py": "def f():\n    import importlib\n    importlib.import_module('kvsidecar.cli.main')\n",
        "store/__init__.py": "",
        "store/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvsidecar.fleet import x\n",
        "store/b.py": "from kvsidecar.fingerprint import c\n",
        "fingerprint/__init__.py": "",
        "fingerprint/c.py": "from kvsidecar.store import a\n",  # a unit cycle, no module cycle
        "fleet/__init__.py": "",
        "fleet/x.py": "def g():\n    from kvsidecar.fleet import y\n",
        "fleet/y.py": "import kvsidecar.fleet.x as x\n",  # a module cycle
        "daemon/__init__.py": "",
        "daemon/service.py": "",
        "cli/__init__.py": "",
        "cli/main.py": "",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    layers = (("kvsidecar", "errors", "logs"), ("fingerprint", "store"), ("fleet",), ("daemon", "cli"))
    graph = import_graph(pkg)
    assert upward_imports(graph, layers) == [
        "kvsidecar.errors (layer 0) imports kvsidecar.daemon.service (layer 3)",
        "kvsidecar.logs (layer 0) imports kvsidecar.cli.main (layer 3)",
        "kvsidecar.store.a (layer 1) imports kvsidecar.fleet.x (layer 2)",
    ]
    assert strongly_connected(graph) == [["kvsidecar.fleet.x", "kvsidecar.fleet.y"]]
    assert strongly_connected(unit_graph(graph, layers)) == [["fingerprint", "store"]]


def test_architecture_doc_names_every_subpackage() -> None:
    doc = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    missing = [name for name in subpackages if f"`{name}/`" not in doc]
    assert missing == []


MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def test_no_module_is_over_the_size_limit() -> None:
    """A module that grows past this has taken on a second concern: split it (ARCHITECTURE.md)."""
    sizes = {module: len(path.read_text().splitlines()) for module, path in MODULES.items()}
    assert sorted(f"{module}: {n} lines" for module, n in sizes.items() if n > MAX_MODULE_LINES) == []


def test_no_function_is_over_the_size_limit() -> None:
    """Counted from `def` to its last line, docstring included."""
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert sorted(long) == []
