"""The import graph of the package has no cycle: a circle means a piece sits in the wrong module.

The graph is read statically (ast), over every source folder setup.py maps into the `flagdeploy` namespace
(flagdeploy/, backends/, installer/, quantize/, profiles/), so a test run needs no optional dependency.

What counts as an edge, decided once:

- every `import` and `from ... import` in a module, at module level *and* inside functions and methods:
  importing late only hides a circle from Python's loader, not from a reader, who still meets two modules that
  each need the other (the circles issue 52 counted were mostly such late imports);
- except imports under `if TYPE_CHECKING:`, which never run and only name types for annotations;
- `from a.b import c` is an edge to module `a.b.c` when that is a module of the tree, else to `a.b`;
- a package (`a/b/__init__.py`) is a node like any module, reached when it is imported by name
  (`from flagdeploy import ops`, `from flagdeploy.ops import X`); importing `a.b.c` is not also counted as an
  import of `a.b`'s `__init__` (Python runs it, but a package's `__init__` re-exporting its submodules would
  otherwise put every package that anything inside it imports into one circle).
"""

from __future__ import annotations

import ast
import runpy
from pathlib import Path

TOP = Path(__file__).resolve().parents[1]
ROOTS: dict[str, str] = runpy.run_path(str(TOP / "setup.py"))["ROOTS"]  # import name -> source folder


def modules() -> dict[str, Path]:
    """Every module of the tree by its import name."""
    found = {}
    for name, folder in ROOTS.items():
        for path in sorted((TOP / folder).rglob("*.py")):
            parts = list(path.relative_to(TOP / folder).with_suffix("").parts)
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([name, *parts])] = path
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the tree that `module` imports anywhere in its body (see the module docstring)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                out.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = ".".join(package[:len(package) - child.level + 1] + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                for alias in child.names:
                    out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return {name for name in out if name in known and name != module}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a path that comes back to its start) per strongly connected component of more than one
    module, or of one module that imports itself (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        components.append(sorted(component))
    return [_circle(graph, set(c)) for c in components]


def _circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle through the component's first module, as the list of modules it passes."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return sorted(component)


def test_the_graph_is_read():
    graph = import_graph()
    assert "flagdeploy.cli" in graph and "flagdeploy.installer.doctor" in graph and "flagdeploy.backends.cpu" in graph
    assert "flagdeploy.engine.llm_engine" in graph["flagdeploy.engine.async_engine"]  # a relative import
    assert "flagdeploy.server.errors" in graph["flagdeploy.gateway.proxy"]  # an absolute one


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(cycles(graph)) == [["a", "b", "c", "a"], ["e", "e"]]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import circles (move the piece that closes each to where it belongs):\n" + "\n".join(
        " -> ".join(circle) for circle in found)
