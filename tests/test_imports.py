"""colibri's import graph, read from the source, has no cycle.

Every ``colibri/**/*.py`` is parsed with ``ast`` (imports inside functions, methods and
``TYPE_CHECKING`` blocks included: a lazy import is still a dependency), and every
``.pyx`` / ``.pxd`` is scanned for its ``import`` and ``cimport`` lines. An import of
``colibri.a.b`` is an edge to ``colibri.a.b`` and to each package above it that the importer
does not sit in (Python runs ``colibri.a``'s ``__init__`` first); ``import colibri`` or
``from colibri import name`` is an edge to the top package itself.

Two graphs must be acyclic: the modules', and the packages' (every module counted as the
top-level package or module under ``colibri`` that holds it, ``colibri`` itself for
``colibri/__init__.py``), which is how the layering reads: each package imports only those
below it. A failure names each cycle, edge by edge, with the file and line of every import.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "colibri"
SUFFIXES = (".py", ".pyx", ".pxd")

# import lines of Cython sources: `import a.b, c`, `cimport a.b`, `from a.b cimport x`,
# `from . import x`; docstrings and comments are blanked out first
_CYTHON_IMPORT = re.compile(
    r"^\s*(?:c?import\s+(?P<names>[\w., ]+)"
    r"|from\s+(?P<base>[\w.]+)\s+c?import\s+(?P<items>.+))"
)
_STRINGS = re.compile(r'"""(?:.|\n)*?"""|\'\'\'(?:.|\n)*?\'\'\'')


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.stem == "__init__"


def _sources() -> dict[str, list[Path]]:
    """Module name -> its files (a ``.pyx`` and its ``.pxd`` are one module)."""
    modules: dict[str, list[Path]] = {}
    for path in sorted(SOURCE.rglob("*")):
        if path.suffix in SUFFIXES and "__pycache__" not in path.parts:
            modules.setdefault(_module_name(path), []).append(path)
    return modules


def _python_imports(path: Path, package: str) -> list[tuple[str, list[str], int]]:
    """(base, names, line) for every import statement; ``names`` empty for ``import base``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, [alias.name for alias in node.names], node.lineno))
    return found


def _cython_imports(path: Path) -> list[tuple[str, list[str], int]]:
    text = _STRINGS.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0]
        match = _CYTHON_IMPORT.match(line)
        if match is None:
            continue
        if match["names"]:
            for name in match["names"].split(","):
                found.append((name.split(" as ")[0].strip(), [], number))
        else:
            items = match["items"].strip().strip("()\\").split(",")
            names = [n.split(" as ")[0].strip() for n in items if n.strip()]
            found.append((match["base"], names, number))
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, dict[str, str]]:
    """module -> {imported module: "file:line" of the first import that makes the edge}."""
    modules = _sources()
    graph: dict[str, dict[str, str]] = {name: {} for name in modules}
    for name, paths in modules.items():
        own = set(_ancestors(name))
        for path in paths:
            package = name if _is_package(path) else name.rpartition(".")[0]
            if path.suffix == ".py":
                imports = _python_imports(path, package)
            else:
                imports = _cython_imports(path)
            for base, names, line in imports:
                if base != "colibri" and not base.startswith("colibri."):
                    continue
                targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
                if len(targets) < len(names) or not names:
                    targets.append(base)  # a name defined in base, or `import base`
                where = f"{path.relative_to(SOURCE.parent)}:{line}"
                for target in targets:
                    implicit = [a for a in _ancestors(target) if a not in own]
                    for edge in (*implicit, target):
                        if edge in modules and edge != name:
                            graph[name].setdefault(edge, where)
    return graph


def package_graph(graph: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The same edges between top-level units: ``colibri.routing._config`` counts as
    ``colibri.routing``; ``colibri/__init__.py`` is ``colibri``."""

    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    units: dict[str, dict[str, str]] = {}
    for module, edges in graph.items():
        here = units.setdefault(unit(module), {})
        for target, where in edges.items():
            if unit(target) != unit(module):
                here.setdefault(unit(target), f"{where} ({module} -> {target})")
    return units


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Every strongly connected component's cycles: the shortest through each member."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan; the graph is small, recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)

    found: list[list[str]] = []
    for component in components:  # the shortest cycle through each member, each cycle once
        members = set(component)
        for start in component:
            cycle = _shortest_cycle(graph, start, members)
            at = cycle.index(min(cycle[:-1]))
            cycle = cycle[at:-1] + cycle[:at] + [cycle[at]]
            if cycle not in found:
                found.append(cycle)
    return found


def _shortest_cycle(graph: dict[str, dict[str, str]], start: str, members: set[str]) -> list[str]:
    """Breadth-first from ``start`` back to itself, inside its component."""
    parents = {start: ""}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    path = [start]
                    while node:
                        path.append(node)
                        node = parents[node]
                    return path[::-1]
                if nxt in members and nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start} is in a cycle but none was found")


def _describe(graph: dict[str, dict[str, str]], cycle: list[str]) -> str:
    steps = [f"  {a} -> {b}   [{graph[a][b]}]" for a, b in zip(cycle, cycle[1:], strict=False)]
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


@pytest.fixture(scope="module")
def graph():
    if not (SOURCE / "__init__.py").is_file():
        pytest.skip(f"colibri's source is not beside the tests ({SOURCE})")
    return import_graph()


def test_the_graph_is_read(graph):
    """The reader sees imports of every kind: top-level, lazy, relative-free, cimport."""
    assert "colibri._core" in graph["colibri.routing._context"]  # from ... import (top)
    assert "colibri._dlpack._capsule" in graph["colibri._core"]  # from ... cimport (.pyx)
    assert "colibri._route" in graph["colibri._core"]
    assert "colibri.routing" in graph["colibri"]  # the package's re-exports
    assert "colibri.routing" in graph["colibri.layer._moe"]  # an import inside a method


def test_modules_import_no_cycle(graph):
    found = cycles(graph)
    assert not found, "import cycles between colibri's modules:\n" + "\n".join(
        _describe(graph, c) for c in found
    )


def test_packages_import_no_cycle(graph):
    units = package_graph(graph)
    found = cycles(units)
    assert not found, "import cycles between colibri's packages:\n" + "\n".join(
        _describe(units, c) for c in found
    )


def _private_part(target: str) -> str | None:
    """The package whose private inside ``target`` reaches (``colibri.layer._ffn`` ->
    ``colibri.layer``), or None: top-level private modules (``colibri._units``) are shared
    leaves, meant for every package."""
    parts = target.split(".")
    for i in range(2, len(parts)):
        if parts[i].startswith("_"):
            return ".".join(parts[:i])
    return None


def test_no_package_reaches_into_another_ones_privates():
    """A package uses another one through its public names only: ``colibri.layer._ffn`` is
    layer's own business, ``colibri.layer.simd_path`` is for everyone. A compiled module's
    ``.pxd`` is its C interface, for other compiled modules to ``cimport``."""
    modules = _sources()
    c_interfaces = {n for n, paths in modules.items() if any(p.suffix == ".pxd" for p in paths)}
    wrong = []
    for name, paths in modules.items():
        for path in paths:
            package = name if _is_package(path) else name.rpartition(".")[0]
            imports = (
                _python_imports(path, package) if path.suffix == ".py" else _cython_imports(path)
            )
            for base, names, line in imports:
                if base != "colibri" and not base.startswith("colibri."):
                    continue
                for target in [base] + [f"{base}.{n}" for n in names]:
                    if target in c_interfaces or target.rpartition(".")[0] in c_interfaces:
                        continue
                    owner = _private_part(target)
                    if owner is not None and not (name + ".").startswith(owner + "."):
                        wrong.append(f"{path.relative_to(SOURCE.parent)}:{line} imports {target}")
    assert not wrong, "private names used across packages:\n  " + "\n  ".join(sorted(set(wrong)))
