"""The package's import graph has no circle: no two modules import each other, directly or through others.

Every import counts, at the top of a file, inside a function (a lazy import) or under TYPE_CHECKING: a
circle of lazy imports is still two modules that each need the other. A package's `__init__.py` only hands
names on, so an import of a package's submodule names the submodule, and `__init__.py` files are not nodes.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "puzzle"
ROOT = PACKAGE.parent


def _module_file(name: str) -> Path | None:
    """The file of module `name` (puzzle.x.y -> puzzle/x/y.py, or a package's __init__.py); None otherwise."""
    path = ROOT.joinpath(*name.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def _imports(file: Path) -> set[Path]:
    """The puzzle modules `file` imports anywhere in its body (`from puzzle.x import y` may name module y)."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(t for name in names if name.split(".")[0] == "puzzle" and (t := _module_file(name)))
    return {t for t in found if t != file and t.name != "__init__.py"}


def import_graph() -> dict[Path, set[Path]]:
    # The remote code is copied into exports and imports nothing of puzzle.
    return {
        f: _imports(f) for f in PACKAGE.rglob("*.py") if f.name != "__init__.py" and "remote" not in f.parts
    }


def circles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found: list[list[Path]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_two_modules_of_the_package_import_each_other():
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(
        " <-> ".join(str(p.relative_to(ROOT)) for p in component) for component in found
    )


def test_the_circle_finder_finds_a_circle():
    a, b, c, d = (Path(name) for name in "abcd")
    assert circles({a: {b}, b: {c}, c: {a}, d: {a}}) == [[a, b, c]]
    assert circles({a: {b}, b: set(), c: {a}}) == []
