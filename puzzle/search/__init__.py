"""The Puzzle search: choose one variant per block to optimise a summed score under budgets and rules.

    from puzzle.search import Table, Bound, Rules, SolverOptions, search, search_k

Modules: `types` (Table, Choice, Rules, SolverOptions, Solution, errors), `mip` (the rows and columns,
dominance presolve), `exact` (`search` / `search_k`: LP bound, fixing, the MIP, the proven gap,
infeasibility diagnosis), `heuristics` (diving, local search, probing), `backend` (HiGHS and CBC through
PuLP), `budget` (deployment budgets: one grammar and one row per key, priced through `puzzle.cost`),
`library` (block library files measured elsewhere), `frontier` (budget sweeps and Pareto frontiers). The
budget syntax and `Bound` live in `puzzle.cost.limits`, the cost model and scenario grammar in
`puzzle.cost.serving`; a run directory's library and
scores under deployment budgets in `puzzle.problem`, a stage above the search. The search imports only
the specs, the costs and file helpers (tests/test_layers.py).
"""

from puzzle._lazy import lazy_attributes as _lazy_attributes
from puzzle.cost.limits import Bound, BudgetError, Limit, Relative, merge_limits, parse_limit, parse_value
from puzzle.search.exact import search, search_k
from puzzle.search.types import Choice, InfeasibleError, Rules, SearchError, Solution, SolverOptions, Table

# Names whose modules pull in the cost model or file handling load on first use, so that a library
# search (`puzzle search --library`) imports only what it runs.
_LAZY_EXPORTS = {
    "Budget": "puzzle.search.budget",
    "CostModel": "puzzle.cost.serving",
    "DeploymentLimit": "puzzle.search.budget",
    "parse_budget": "puzzle.search.budget",
    "DeploymentProblem": "puzzle.search.budget",
    "deployment_problem": "puzzle.search.budget",
    "choices_to_spec": "puzzle.search.budget",
    "load_library": "puzzle.search.library",
    "sweep": "puzzle.search.frontier",
    "write_frontier": "puzzle.search.frontier",
}


__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY_EXPORTS)  # and submodules, e.g. `budget`


__all__ = [
    "Bound",
    "Budget",
    "BudgetError",
    "Choice",
    "CostModel",
    "DeploymentLimit",
    "DeploymentProblem",
    "InfeasibleError",
    "Limit",
    "Relative",
    "Rules",
    "SearchError",
    "Solution",
    "SolverOptions",
    "Table",
    "choices_to_spec",
    "deployment_problem",
    "load_library",
    "merge_limits",
    "parse_budget",
    "parse_limit",
    "parse_value",
    "search",
    "search_k",
    "sweep",
    "write_frontier",
]
