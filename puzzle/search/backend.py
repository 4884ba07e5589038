"""Solver back ends for the search MIP: the LP relaxation (HiGHS directly) and MIPs through PuLP (HiGHS or CBC).

A model is a minimisation objective over columns and a list of rows `lower <= sum coefs x[cols] <= upper`;
every function solves it restricted to a subset of the columns (the others are held at 0).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from puzzle.cost.limits import BOUND_RTOL
from puzzle.search.types import SearchError

# The MIP back ends hold rows and integrality to this (HiGHS's mip_feasibility_tolerance and
# primal_feasibility_tolerance, CBC's primal and integer tolerances; their defaults are 1e-6 / 1e-7). On
# rows scaled to a bound of 1 (`puzzle.search.mip.row_scale`) it is the relative tolerance `within_bounds`
# judges the answer by: at the defaults an answer just outside a bound is taken as an incumbent, prunes the
# nodes holding the true optimum, and is dropped at the end, leaving a worse architecture called optimal.
FEASIBILITY_TOLERANCE = BOUND_RTOL

if TYPE_CHECKING:
    import pulp


@functools.cache
def highs_installed() -> bool:
    """Whether highspy is installed. HiGHS is the default solver, CBC (bundled with PuLP) the fallback.

    Asked without importing highspy (~30 ms), which the functions that call HiGHS import on first use: a
    search the knapsack path answers never loads it.
    """
    return importlib.util.find_spec("highspy") is not None


def resolve_solver(name: str) -> str:
    """The back end a `SolverOptions.solver` stands for: "auto" is HiGHS if highspy is installed, else CBC."""
    if name == "auto":
        return "highs" if highs_installed() else "cbc"
    if name not in ("highs", "cbc"):
        raise SearchError(f"unknown solver {name!r}; choose 'auto', 'highs' or 'cbc'")
    if name == "highs" and not highs_installed():
        raise SearchError("solver 'highs' needs the highspy package (pip install highspy)")
    return name


@dataclass
class Row:
    """One linear row over columns (flat variant indices, or rule binaries numbered from N)."""

    cols: np.ndarray
    coefs: np.ndarray
    lower: float
    upper: float
    label: str


@dataclass
class RowModel:
    """minimise objective . x subject to rows, x in [0, 1] (binary in a MIP)."""

    objective: np.ndarray  # [columns]
    rows: list[Row]


@dataclass
class BackendResult:
    """What a back end returns; `values` and `reduced_costs` follow the order of the columns it was given.

    `bound` is the best proven lower bound on the objective over the solved subset (the LP's optimum, a
    MIP's dual bound), None when the solver gave none; a MIP's `status` is the solver's own claim."""

    status: str  # "optimal" | "time_limit" | "infeasible" | "error"
    objective: float | None = None
    values: np.ndarray | None = None  # per column of the solved subset
    reduced_costs: np.ndarray | None = None
    bound: float | None = None


_BANNER_SILENCED = False


def new_highs() -> Any:
    """A silent highspy.Highs. The first one in a process prints a banner to fd 1 from C; keep stdout clean."""
    import highspy

    global _BANNER_SILENCED
    if not _BANNER_SILENCED:
        _BANNER_SILENCED = True
        with contextlib.suppress(OSError):
            saved = os.dup(1)
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, 1)
                solver = highspy.Highs()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
                os.close(devnull)
            solver.setOptionValue("output_flag", False)
            return solver
    solver = highspy.Highs()
    solver.setOptionValue("output_flag", False)
    return solver


def _csc(
    problem: RowModel, columns: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The constraint matrix restricted to `columns` (sorted global ids), column-wise, plus row bounds."""
    position = -np.ones(len(problem.objective), dtype=np.int64)
    position[columns] = np.arange(len(columns))
    row_ids, col_ids, values = [], [], []
    for index, row in enumerate(problem.rows):
        keep = position[row.cols] >= 0
        keep &= row.coefs != 0
        row_ids.append(np.full(int(keep.sum()), index))
        col_ids.append(position[row.cols[keep]])
        values.append(row.coefs[keep])
    rows = np.concatenate(row_ids)
    cols = np.concatenate(col_ids)
    vals = np.concatenate(values)
    order = np.lexsort((rows, cols))
    starts = np.searchsorted(cols[order], np.arange(len(columns) + 1))
    lower = np.array([row.lower for row in problem.rows])
    upper = np.array([row.upper for row in problem.rows])
    return starts, rows[order], vals[order], lower, upper


class LPSession:
    """The LP relaxation on `columns` held in one HiGHS instance, so that bound changes re-solve warm
    (a few simplex iterations each). Used for diving (an incumbent) and probing (fixing columns)."""

    def __init__(self, problem: RowModel, columns: np.ndarray, deadline: float | None = None) -> None:
        import highspy

        starts, index, value, row_lower, row_upper = _csc(problem, columns)
        lp = highspy.HighsLp()
        lp.num_col_ = len(columns)
        lp.num_row_ = len(problem.rows)
        lp.col_cost_ = problem.objective[columns]
        lp.col_lower_ = np.zeros(len(columns))
        lp.col_upper_ = np.ones(len(columns))
        inf = highspy.kHighsInf
        lp.row_lower_ = np.where(np.isfinite(row_lower), row_lower, -inf)
        lp.row_upper_ = np.where(np.isfinite(row_upper), row_upper, inf)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = starts
        lp.a_matrix_.index_ = index
        lp.a_matrix_.value_ = value
        self.columns = columns
        self.deadline = deadline
        self.solver = new_highs()
        self.solver.passModel(lp)

    def set_bounds(self, column: int, lower: float, upper: float) -> None:
        """Bounds of the session's column `column` (a position in `columns`)."""
        self.solver.changeColBounds(int(column), float(lower), float(upper))

    def solve(self) -> BackendResult:
        import highspy

        if self.deadline is not None:
            self.solver.setOptionValue("time_limit", max(0.01, self.deadline - time.perf_counter()))
        self.solver.run()
        status = self.solver.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            return BackendResult("infeasible")
        if status != highspy.HighsModelStatus.kOptimal:
            return BackendResult("error")
        solution = self.solver.getSolution()
        objective = self.solver.getInfo().objective_function_value
        return BackendResult(
            "optimal", objective, np.array(solution.col_value), np.array(solution.col_dual), objective
        )


def _lp_highs(problem: RowModel, columns: np.ndarray, deadline: float | None) -> BackendResult:
    return LPSession(problem, columns, deadline).solve()


def _pulp_model(
    problem: RowModel, columns: np.ndarray, integer: bool
) -> tuple[pulp.LpProblem, list[pulp.LpVariable]]:
    import pulp

    model = pulp.LpProblem("puzzle_search", pulp.LpMinimize)
    category = pulp.LpBinary if integer else pulp.LpContinuous
    # PuLP hands variables to the solver sorted by name: zero-pad so that the solver sees them in block
    # order (as "x10" < "x9" would not), which keeps HiGHS's branching order stable and block-wise.
    width = len(str(len(problem.objective)))
    variables = [model.add_variable(f"x{column:0{width}d}", 0, 1, category) for column in columns]
    position = -np.ones(len(problem.objective), dtype=np.int64)
    position[columns] = np.arange(len(columns))
    model += pulp.LpAffineExpression(
        [
            (variables[i], float(problem.objective[column]))
            for i, column in enumerate(columns)
            if problem.objective[column] != 0
        ]
    )
    for number, row in enumerate(problem.rows):
        keep = (position[row.cols] >= 0) & (row.coefs != 0)
        if not keep.any():
            if row.lower <= 0.0 <= row.upper:
                continue  # an empty row that holds
            # An empty row that fails: keep it, on a variable pinned to 0, so the solver reports infeasible.
            keep_var = model.add_variable(f"zero{number}", 0, 0)
            expression = pulp.LpAffineExpression([(keep_var, 1.0)])
        else:
            expression = pulp.LpAffineExpression(
                [(variables[p], float(c)) for p, c in zip(position[row.cols[keep]], row.coefs[keep])]
            )
        if row.lower == row.upper:
            model += (expression == row.lower, f"r{number}")
            continue
        if math.isfinite(row.upper):
            model += (expression <= row.upper, f"r{number}u")
        if math.isfinite(row.lower):
            model += (expression >= row.lower, f"r{number}l")
    return model, variables


# HiGHS options for the reduced MIP that follows reduced-cost fixing: there the incumbent is already good
# and every column left is close to the LP bound, so the root's sub-MIP heuristics (RINS, RENS) seldom
# improve it and cost a third or more of the solve (measured: 0.54 -> 0.40 s at 88 x 100 uniform,
# 0.36 -> 0.16 s correlated, same node counts). The plain model keeps HiGHS's defaults.
REDUCED_MIP_HIGHS_OPTIONS: dict[str, Any] = {
    "mip_heuristic_run_rins": False,
    "mip_heuristic_run_rens": False,
}


def _pulp_solver(
    name: str,
    integer: bool,
    gap_rel: float,
    time_limit: float | None,
    highs_options: dict[str, Any] | None = None,
    log_path: str | None = None,
) -> Any:
    import pulp

    if name == "highs":
        tolerances = {
            "mip_feasibility_tolerance": FEASIBILITY_TOLERANCE,
            "primal_feasibility_tolerance": FEASIBILITY_TOLERANCE,
        }
        return pulp.HiGHS(
            msg=False,
            mip=integer,
            gapRel=gap_rel,
            timeLimit=time_limit,
            **{**tolerances, **(highs_options or {})},
        )
    with (
        warnings.catch_warnings()
    ):  # PuLP 3 deprecates its bundled CBC; it stays the no-extra-install fallback
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(
            msg=False,
            mip=integer,
            gapRel=gap_rel,
            timeLimit=None if time_limit is None else max(1, math.ceil(time_limit)),
            logPath=log_path,
            options=[
                f"primalTolerance {FEASIBILITY_TOLERANCE:g}",
                f"integerTolerance {FEASIBILITY_TOLERANCE:g}",
            ],
        )


def cbc_gap_from_log(text: str) -> float | None:
    """CBC's proven absolute gap (objective - lower bound) from its log, or None if the log has no answer.

    PuLP does not hand CBC's bound back, so it is read from the summary CBC prints: "Optimal solution
    found" alone means the tree was searched to the end (gap 0); otherwise (within the gap tolerance,
    stopped on a limit) it prints "Objective value:" and "Lower bound:" (the bound to 3 decimals, which
    the search's objective scaling makes ~1e-9 of the objective's range)."""
    objective = re.search(r"^Objective value:\s*(\S+)", text, re.MULTILINE)
    bound = re.search(r"^Lower bound:\s*(\S+)", text, re.MULTILINE)
    if objective is None:
        return None
    if bound is None:
        return 0.0 if re.search(r"^Result - Optimal solution found\s*$", text, re.MULTILINE) else None
    try:
        return max(0.0, float(objective.group(1)) - float(bound.group(1)))
    except ValueError:
        return None


def solve_with_pulp(
    problem: RowModel,
    columns: np.ndarray,
    integer: bool,
    solver_name: str,
    gap_rel: float,
    deadline: float | None,
    cutoff: float | None = None,
    highs_options: dict[str, Any] | None = None,
) -> BackendResult:
    """Solve the (sub)problem on `columns` through PuLP; LP gives reduced costs, a MIP its proven bound.

    `cutoff` (HiGHS only): prune every node whose bound reaches it (HiGHS's objective_bound). Then the
    answer means "the optimum, or no solution below `cutoff` exists": the caller must hold a solution of
    value <= cutoff and keep it when the one returned is no better. `highs_options` go to HiGHS as they are.
    """
    import pulp  # on first use: a search the knapsack path answers never loads PuLP (~60 ms)

    if solver_name == "highs":
        new_highs()  # silence the banner before PuLP constructs its own Highs
    model, variables = _pulp_model(problem, columns, integer)
    time_limit = None if deadline is None else max(0.05, deadline - time.perf_counter())
    options = dict(highs_options or {})
    if cutoff is not None and solver_name == "highs":
        options["objective_bound"] = float(cutoff)
    log_text = ""
    if solver_name == "cbc" and integer:
        import tempfile  # late, as PuLP: only CBC's log needs it

        with tempfile.TemporaryDirectory(prefix="puzzle_cbc_") as folder:
            log_path = os.path.join(folder, "cbc.log")
            model.solve(_pulp_solver(solver_name, integer, gap_rel, time_limit, options, log_path))
            with contextlib.suppress(OSError):
                log_text = Path(log_path).read_text()
    else:
        model.solve(_pulp_solver(solver_name, integer, gap_rel, time_limit, options))
    values = np.array([variable.varValue if variable.varValue is not None else 0.0 for variable in variables])
    status = pulp.LpStatus[model.status]
    has_solution = model.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if solver_name == "highs" and integer and model.solverModel.getInfo().primal_solution_status != 2:
        import highspy

        # No solution in hand. PuLP reads HiGHS's kObjectiveBound (the search ended: nothing below the
        # cutoff) as a feasible answer; it means "infeasible below the cutoff", unlike a limit reached.
        has_solution = False
        ended = model.solverModel.getModelStatus() in (
            highspy.HighsModelStatus.kObjectiveBound,
            highspy.HighsModelStatus.kInfeasible,
        )
        status = "Infeasible" if ended else "Not Solved"
    if status == "Infeasible" or (not has_solution and status != "Optimal"):
        timed_out = deadline is not None and time.perf_counter() >= deadline - 0.05
        return BackendResult("time_limit" if timed_out and status != "Infeasible" else "infeasible")
    objective = float(problem.objective[columns] @ values)
    result = BackendResult(
        "optimal" if model.sol_status == pulp.LpSolutionOptimal else "time_limit", objective, values
    )
    if not integer:
        result.reduced_costs = np.array(
            [variable.dj if variable.dj is not None else 0.0 for variable in variables]
        )
        result.bound = objective if result.status == "optimal" else None
    elif solver_name == "highs":
        dual_bound = float(model.solverModel.getInfo().mip_dual_bound)
        result.bound = min(dual_bound, objective) if math.isfinite(dual_bound) else None
    else:
        absolute_gap = cbc_gap_from_log(log_text)
        result.bound = None if absolute_gap is None else objective - absolute_gap
    return result


def solve_lp(
    problem: RowModel, columns: np.ndarray, solver_name: str, deadline: float | None
) -> BackendResult:
    if highs_installed():
        return _lp_highs(problem, columns, deadline)
    return solve_with_pulp(problem, columns, False, solver_name, 0.0, deadline)
