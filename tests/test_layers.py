"""The package's layers: the search sits below the stages, and no module reaches into another's private names.

The search (`puzzle/search/`) is a solver over tables of costs: it may import the specs, the cost model
(costs, budget syntax) and the small file and progress helpers, never a stage (BLD, scoring, GKD, a run
directory's files: those read the search, not the other way). A module's leading-underscore names are its
own: another module that needs one names a public function instead, so that a stage's internals can change
without reaching into the modules beside it.
"""

from __future__ import annotations

import ast

from test_import_graph import PACKAGE, ROOT, import_graph

SEARCH = PACKAGE / "search"
# What the search may import besides itself: the specs, the cost model and three helpers without stages.
SEARCH_MAY_IMPORT = ("spec.py", "cost/", "files.py", "progress.py", "_lazy.py")
# The training and scoring stages stand side by side: each asks the planner, the library and score files and
# the helpers below them, never another stage, directly or through a module between.
STAGES = ("bld.py", "score.py", "gkd.py", "assemble.py")


def _relative(path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def test_the_search_imports_only_specs_costs_and_helpers():
    graph = import_graph()
    wrong = sorted(
        f"{_relative(module)} -> {_relative(target)}"
        for module, targets in graph.items()
        if module.is_relative_to(SEARCH)
        for target in targets
        if not target.is_relative_to(SEARCH) and not _relative(target).startswith(SEARCH_MAY_IMPORT)
    )
    assert wrong == [], wrong
    assert graph, "no module found: the graph is empty"


def _reach(graph, start):
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_stages_import_no_other_stage():
    graph = import_graph()
    stages = [PACKAGE / name for name in STAGES]
    assert all(stage in graph for stage in stages), [s.name for s in stages if s not in graph]
    wrong = sorted(
        f"{stage.name} -> {other.name}"
        for stage in stages
        for other in stages
        if other != stage and other in _reach(graph, stage)
    )
    assert wrong == [], wrong


def test_the_reach_follows_imports_through_modules_between():
    a, b, c = (PACKAGE / name for name in ("a.py", "b.py", "c.py"))
    assert _reach({a: {b}, b: {c}, c: set()}, a) == {b, c}


def test_no_module_imports_another_modules_private_names():
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        if "remote" in file.parts:  # copied into exports; imports nothing of puzzle
            continue
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("puzzle")
            ):
                found += [
                    f"{file.relative_to(ROOT)}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    assert found == [], found
