"""The package's layers (docs/ARCHITECTURE.md): a module imports only from its own layer or below, and no
modules import each other in a cycle. Every import counts: module level, inside functions and under
TYPE_CHECKING alike (a lazy import is still a dependency, and a cycle hidden in a function is still one)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvsidecar"

# Lowest first. A top-level module or subpackage of kvsidecar is in exactly one layer; ARCHITECTURE.md
# draws the same table.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kvsidecar", "errors", "logs", "metrics", "buildcheck", "defaults", "units"),  # base: no domain
    ("config",),  # the configuration model and its file
    (
        "store",
        "fingerprint",
        "backend",
        "client",
    ),  # snapshots on disk; runtime identity; llama-server; hook client
    ("coordinator", "retention"),  # the decisions: slots, sessions, restore/save/erase; what to delete
    ("http",),  # the HTTP machinery: route table, dispatcher, listener limits, OpenAPI
    (
        "api",
        "proxy",
        "fleet",
        "doctor",
    ),  # adapters: hook API, llama-server-compatible proxy, fleet, set-up checks
    ("daemon", "cli", "demo", "testing", "__main__"),  # composition roots: the daemon, the command, test rigs
)


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> Iterator[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names
            ]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                yield target


GRAPH = {module: set(_imports(module)) for module in MODULES}


def layer_of(module: str) -> int:
    parts = module.split(".")
    unit = parts[1] if len(parts) > 1 else parts[0]
    for index, members in enumerate(LAYERS):
        if unit in members:
            return index
    raise AssertionError(f"{module} is in no layer: add `{unit}` to LAYERS and to docs/ARCHITECTURE.md")


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_no_module_imports_a_higher_layer() -> None:
    upward = sorted(
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in GRAPH.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    )
    assert upward == []


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


def test_the_layer_check_sees_an_upward_import() -> None:
    """The check is not vacuous: the store really imports modules of its own layer, and a module of the
    lowest layer importing the coordinator would be reported."""
    assert "kvsidecar.store.confined" in GRAPH["kvsidecar.store.snapshots"]
    assert layer_of("kvsidecar.coordinator.core") > layer_of("kvsidecar.errors")


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
