"""The tree shows the architecture (CONTRIBUTING.md): ``hops/`` never imports ``passes/``,
and the modules of ``hops`` import each other in one direction (no two modules import each
other through any chain, counting imports inside functions and under ``TYPE_CHECKING``)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, known: set[str]) -> set[str]:
    """The modules ``source`` imports anywhere in it (at the top, in functions, under ``if``):
    ``import a.b``, ``from a.b import c`` (``a.b.c`` where that is one of ``known``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                inner = f"{node.module}.{alias.name}"
                found.add(inner if inner in known else node.module)
    return found


def import_graph(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (its ``__init__`` aside: it imports the public names) and
    the modules it imports, of any package."""
    paths = {_module_name(p): p for p in (ROOT / package).rglob("*.py")}
    return {name: imported_modules(path.read_text(), set(paths)) for name, path in paths.items() if name != package}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in graph:
                continue
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_hops_never_imports_passes():
    found = sorted(f"{module} imports {other}" for module, imported in import_graph("hops").items() for other in imported if other.split(".")[0] == "passes")
    assert found == [], "hops/ defines the HOPs; passes/ builds on it, never the other way:\n" + "\n".join(found)


def test_the_modules_of_hops_import_each_other_without_a_cycle():
    assert cycles(import_graph("hops")) == []


def test_the_checks_see_what_they_look_for():
    # Each form of import counts, wherever it is written.
    known = {"hops.a", "hops.a.b"}
    source = "import passes.x\nif TYPE_CHECKING:\n    from hops.a import b\ndef f():\n    from hops import a\n"
    assert imported_modules(source, known) == {"passes.x", "hops.a.b", "hops.a"}
    graph = {"a": {"b"}, "b": {"c", "torch"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
