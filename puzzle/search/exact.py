"""The exact search: choose one variant per block to optimise the summed score under budgets and global rules.

Without rule columns or earlier solutions to differ from, `mckp` (an exact bounded dynamic programme for
the multiple-choice knapsack) answers first; the MIP path below is the fallback when it gives up.

A grouped (multiple-choice) knapsack, solved exactly and fast:
1. presolve: per block, drop variants another one beats or ties in score and every budgeted cost;
2. the LP relaxation (HiGHS) gives a bound z_LP and reduced costs r;
3. an incumbent z_inc (LP diving, then one- and two-block swap local search; re-checked on every row);
4. every variable with r > z_inc - z_LP is fixed to 0 (an LP argument: any solution using it costs more
   than z_inc), then LP probing fixes each remaining variable whose LP with it forced to 1 exceeds z_inc;
5. one MIP (HiGHS through PuLP, CBC when highspy is missing) on what is left, with z_inc as HiGHS's
   cutoff; skipped when z_inc is within gap_rel of z_LP or one variant per block is left. Every fixing
   only removed solutions worse than z_inc, so the MIP's optimum (or z_inc) is the whole problem's.
Without highspy (or with heuristics off) step 3-4 become: fix r > g for a guessed g, solve, and accept
the answer z when z - z_LP <= g; otherwise set g = z - z_LP and solve once more (which then certifies).
The gap reported is proven: the least of the bounds behind each fixing (z_inc, or z_LP + g) and the
reduced MIP's dual bound, never below z_LP; "optimal" means that gap is within gap_rel.

The answer is then checked on the table's un-scaled float64 sums (`puzzle.search.mip.broken_limits`), to
`puzzle.cost.limits.BOUND_RTOL` of each bound: the solvers hold the (scaled) rows to their own feasibility
tolerance, ~1e-6 of the row, and an optimum exploits it. An answer that breaks a budget is solved again with
that budget tightened by a few times its excess (at least 1e-7 of the row, growing each try), at most
`RETIGHTEN` times, then refused. Only architectures within that margin of the bound are lost by it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from puzzle.cost.limits import BOUND_RTOL, Bound, within_bounds
from puzzle.search import mckp
from puzzle.search.backend import (
    REDUCED_MIP_HIGHS_OPTIONS,
    highs_installed,
    resolve_solver,
    solve_lp,
    solve_with_pulp,
)
from puzzle.search.heuristics import dive, improve, probe, rows_hold
from puzzle.search.mip import (
    Broken,
    Problem,
    broken_limits,
    build_problem,
    feasible_choices,
    resolve_limits,
    row_scale,
)
from puzzle.search.types import InfeasibleError, Rules, SearchError, Solution, SolverOptions, Table

_log = logging.getLogger(__name__)


@dataclass
class _Outcome:
    """A solve's answer: the choices (None: no solution), status, proven relative gap, free columns."""

    choices: tuple[int, ...] | None
    status: str
    gap: float | None
    free: int
    solver: str | None = None  # what answered, when not the MIP back end ("mckp": the knapsack search)


def _extract(problem: Problem, columns: np.ndarray, values: np.ndarray) -> tuple[int, ...]:
    table = problem.table
    chosen = np.zeros(len(problem.objective))
    chosen[columns] = values
    picks = []
    for block in range(table.num_blocks):
        start, stop = table.offsets[block], table.offsets[block + 1]
        picks.append(int(np.argmax(chosen[start:stop])))
    return tuple(picks)


def proven_gap(objective: float, bound: float | None, round_off: float) -> float | None:
    """(objective - bound) / |objective| for a minimisation, 0 when the difference is within `round_off`
    (solver tolerance), None without a bound. `round_off` also floors the denominator (objective ~ 0)."""
    if bound is None or not math.isfinite(bound):
        return None
    difference = objective - bound
    if difference <= round_off:
        return 0.0
    return difference / max(abs(objective), round_off)


def _finish(
    problem: Problem, choices: tuple[int, ...], bound: float | None, free: int, gap_rel: float
) -> _Outcome:
    """The outcome for `choices` given a proven lower `bound` on the whole problem's (scaled) objective:
    "optimal" exactly when the proven gap is at most `gap_rel`, else "time_limit"."""
    rows = problem.table.offsets[:-1] + np.asarray(choices)
    objective = float(problem.objective[rows].sum())
    gap = proven_gap(objective, bound, problem.round_off)
    return _Outcome(choices, "optimal" if gap is not None and gap <= gap_rel else "time_limit", gap, free)


def _best_bound(lp_bound: float, *bounds: float | None) -> float:
    """The whole problem's lower bound from the parts it was split into (min over the parts, each None =
    unknown), never below the LP bound, which holds for everything."""
    parts = [-math.inf if bound is None else bound for bound in bounds]
    return max(lp_bound, min(parts))


def _solve_plain(problem: Problem, options: SolverOptions, deadline: float | None) -> _Outcome:
    """The MIP on every alive column, as the solver gives it."""
    alive = np.flatnonzero(problem.alive)
    result = solve_with_pulp(problem, alive, True, resolve_solver(options.solver), options.gap_rel, deadline)
    if result.values is None:
        return _Outcome(None, result.status, None, len(alive))
    choices = _extract(problem, alive, result.values)
    return _finish(problem, choices, result.bound, len(alive), options.gap_rel)


def _solve_problem(problem: Problem, options: SolverOptions, deadline: float | None) -> _Outcome:
    """Optimise `problem` exactly: LP bound, reduced-cost fixing, reduced MIP, certificate (see module doc).

    The reported gap is proven for the whole problem: every fixing step records the bound it rests on
    (solutions it removed cost at least that), and the whole bound is the least of those and the reduced
    MIP's own bound (and never below the LP's)."""
    solver_name = resolve_solver(options.solver)
    alive = np.flatnonzero(problem.alive)
    n_var = problem.table.num_variants
    if not options.fixing:
        return _solve_plain(problem, options, deadline)
    if options.heuristics and mckp.applies(problem):
        answer = mckp.solve(problem, options.gap_rel, deadline)
        if answer is not None:
            choices, bound, used = answer
            if choices is None:
                return _Outcome(None, "infeasible", None, 0)
            return dataclasses.replace(_finish(problem, choices, bound, used, options.gap_rel), solver="mckp")
        _log.debug("the knapsack search gave up; solving the MIP")

    lp = solve_lp(problem, alive, solver_name, deadline)
    if lp.status == "infeasible":
        return _Outcome(None, "infeasible", None, 0)
    if lp.status != "optimal" or lp.reduced_costs is None or lp.objective is None:
        return _solve_plain(problem, options, deadline)  # the LP did not finish cleanly

    lp_bound = lp.objective
    reduced = lp.reduced_costs.copy()
    is_variant = alive < n_var
    # Numerical slack so that a reduced cost a hair above g (simplex round-off) never cuts the optimum.
    slack = 1e-7 * max(1.0, abs(lp_bound)) + 1e-9
    # First guess: keep about 4 variables per block (the LP support plus its nearest neighbours).
    target = min(int(is_variant.sum()), 4 * problem.table.num_blocks + 50)
    sorted_costs = np.sort(reduced[is_variant])
    threshold = max(float(sorted_costs[target - 1]) if target > 0 else 0.0, slack)
    if highs_installed() and options.heuristics and solver_name == "highs":
        # With an incumbent the fixing is certified at once (threshold = incumbent - LP bound), and
        # probing shrinks the free set further before the only MIP. Not for CBC: its fast branch and
        # bound on the guessed fixing certified sooner than diving + probing in every benchmark row.
        initial = alive[(reduced <= threshold + slack) | ~is_variant | (lp.values > 1e-9)]
        incumbent = _incumbent(problem, initial, deadline)
        if incumbent is not None:
            return _solve_from_incumbent(problem, options, deadline, alive, lp, incumbent, initial, slack)
    for _ in range(60):
        free_mask = (reduced <= threshold + slack) | ~is_variant | (lp.values > 1e-9)
        columns = alive[free_mask]
        everything = len(columns) == len(alive)
        result = solve_with_pulp(
            problem,
            columns,
            True,
            solver_name,
            options.gap_rel,
            deadline,
            highs_options=REDUCED_MIP_HIGHS_OPTIONS,
        )
        if result.values is None:
            if result.status == "infeasible" and not everything:
                threshold = max(
                    threshold * 4.0,
                    float(np.quantile(sorted_costs, min(1.0, 4 * len(columns) / len(sorted_costs)))),
                )
                continue
            return _Outcome(None, result.status, None, len(columns))
        choices = _extract(problem, columns, result.values)
        objective = float(problem.objective[columns] @ result.values)
        # A fixed column has reduced cost > threshold + slack: every solution using it costs at least this.
        fixed_bound = math.inf if everything else lp_bound + threshold + slack
        certified = objective <= fixed_bound
        _log.debug(
            "LP bound %.9g, reduced MIP %.9g (%s), threshold %.3g, %d free columns",
            lp_bound,
            objective,
            result.status,
            threshold,
            len(columns),
        )
        if certified or result.status != "optimal":
            bound = _best_bound(lp_bound, result.bound, fixed_bound)
            return _finish(problem, choices, bound, len(columns), options.gap_rel)
        threshold = objective - lp_bound + slack
    raise SearchError("reduced-cost fixing did not converge")  # pragma: no cover - bounded by the loop


def _incumbent(problem: Problem, columns: np.ndarray, deadline: float | None) -> np.ndarray | None:
    """The best of two LP dives (free and locking), each improved by swap local search; 0/1 values on
    `columns`, or None when both dives fail. Every candidate is re-checked on every row: the fixing's
    certificate rests on the incumbent being feasible."""
    n_var = problem.table.num_variants
    block_of_column = np.where(columns < n_var, problem.table.block_of[np.minimum(columns, n_var - 1)], -1)
    best, best_value = None, math.inf
    for lock in (False, True):
        start = dive(problem, columns, 4 * problem.table.num_blocks + 20, deadline, lock_integral=lock)
        if start is None:
            continue
        improved = improve(problem, columns, start, block_of_column, problem.table.num_blocks, deadline)
        for candidate in (improved, start):
            value = float(problem.objective[columns] @ candidate)
            if value < best_value and rows_hold(problem, columns, candidate):
                best, best_value = candidate, value
                break
    return best


def _solve_from_incumbent(
    problem: Problem,
    options: SolverOptions,
    deadline: float | None,
    alive: np.ndarray,
    lp,
    incumbent_values: np.ndarray,
    incumbent_columns: np.ndarray,
    slack: float,
) -> _Outcome:
    """Reduced-cost fixing against a known incumbent (certified by construction), probing, one MIP."""
    incumbent = float(problem.objective[incumbent_columns] @ incumbent_values)
    is_variant = alive < problem.table.num_variants
    threshold = max(incumbent - lp.objective, 0.0)
    columns = alive[(lp.reduced_costs <= threshold + slack) | ~is_variant | (lp.values > 1e-9)]
    fixed = probe(problem, columns, columns < problem.table.num_variants, incumbent, slack, deadline)
    columns = columns[~fixed]
    # Reduced-cost fixing and probing removed only columns whose LP bound exceeds incumbent + slack.
    fixed_bound = incumbent + slack
    incumbent_choices = _extract(problem, incumbent_columns, incumbent_values)
    variant_columns = columns[columns < problem.table.num_variants]
    if len(variant_columns) == problem.table.num_blocks:
        # Fixing left one variant per block (every block keeps the incumbent's): nothing else remains.
        return _finish(problem, incumbent_choices, incumbent, len(columns), options.gap_rel)
    lp_gap = proven_gap(incumbent, lp.objective, problem.round_off)
    if lp_gap is not None and lp_gap <= options.gap_rel:
        return _finish(problem, incumbent_choices, lp.objective, len(columns), options.gap_rel)
    # The incumbent is the MIP's cutoff (HiGHS prunes every node whose bound reaches it); the slack
    # keeps the incumbent itself below the cutoff, so the MIP normally returns it or something better.
    cutoff = incumbent + slack
    result = solve_with_pulp(
        problem,
        columns,
        True,
        resolve_solver(options.solver),
        options.gap_rel,
        deadline,
        cutoff=cutoff,
        highs_options=REDUCED_MIP_HIGHS_OPTIONS,
    )
    _log.debug(
        "LP bound %.9g, incumbent %.9g, %d free columns after fixing and probing, MIP %s",
        lp.objective,
        incumbent,
        len(columns),
        result.status,
    )
    if result.status == "infeasible":
        # Nothing below the cutoff among the free columns: the incumbent is optimal.
        return _finish(problem, incumbent_choices, incumbent, len(columns), options.gap_rel)
    bound = _best_bound(lp.objective, result.bound, fixed_bound)
    if result.values is None:
        # The MIP stopped (time limit) without a solution: the incumbent is what there is.
        return _finish(problem, incumbent_choices, bound, len(columns), options.gap_rel)
    objective = float(problem.objective[columns] @ result.values)
    # No better than the incumbent (within the MIP's tolerance): keep the incumbent.
    choices = incumbent_choices if objective > incumbent else _extract(problem, columns, result.values)
    return _finish(problem, choices, bound, len(columns), options.gap_rel)


def _check(table: Table, choices: Sequence[int], resolved, rules: Rules) -> None:
    """The solver's answer is re-checked on the tables, never trusted blindly."""
    if feasible_choices(table, [choices], resolved, rules)[0]:
        return
    totals = table.totals(choices)
    bounds = "; ".join(
        f"{limit}: {totals[limit.key] - table.fixed.get(limit.key, 0.0)} in [{lower}, {upper}]"
        for limit, lower, upper in resolved
    )
    raise SearchError(
        f"internal error: solution {list(choices)} breaks a limit or mixes {rules.shared_attributes()} values"
        f" ({bounds})"
    )


def _make_solution(
    table: Table, choices: tuple[int, ...], outcome: _Outcome, solver: str, seconds: float, dropped: int
) -> Solution:
    rows = table.offsets[:-1] + np.asarray(choices)
    return Solution(
        choices=choices,
        names={
            block: table.variant_names[b][c] for b, (block, c) in enumerate(zip(table.block_names, choices))
        },
        objective=float(table.score[rows].sum()),
        totals=table.totals(choices),
        status=outcome.status,
        gap=outcome.gap,
        solver=solver,
        seconds=seconds,
        presolve_dropped=dropped,
        free_variables=outcome.free,
    )


def _objective_vector(table: Table) -> np.ndarray:
    return -table.score if table.maximize else table.score


def search(
    table: Table,
    limits: Sequence[Bound] = (),
    rules: Rules | None = None,
    options: SolverOptions | None = None,
    previous: Sequence[Sequence[int]] = (),
    min_diff: int = 1,
) -> Solution:
    """The best architecture under `limits` and `rules` (differing from each of `previous` in >= min_diff blocks).

    Raises InfeasibleError naming the budget that cannot be met and the best value reachable for it.
    """
    rules, options = rules or Rules(), options or SolverOptions()
    started = time.perf_counter()
    deadline = None if options.time_limit_s is None else started + options.time_limit_s
    resolved = resolve_limits(table, limits)
    solving = list(resolved)  # what the solver is given: `resolved`, tightened where an answer broke it
    broken: list[Broken] = []
    for attempt in range(RETIGHTEN + 1):
        bounds = [(str(limit), table.cost(limit.key), lower, upper) for limit, lower, upper in solving]
        problem = build_problem(
            table, _objective_vector(table), bounds, rules, previous, min_diff, options.presolve
        )
        outcome = _solve_problem(problem, options, deadline)
        if outcome.choices is None:
            if outcome.status == "infeasible":
                if previous:
                    raise InfeasibleError(
                        f"no further architecture differs from the {len(previous)} found in >= {min_diff} "
                        "blocks",
                        None,
                        None,
                        [],
                    )
                if broken:  # the budgets are met only within the solvers' tolerance, if at all
                    first = broken[0]
                    raise InfeasibleError(
                        "no architecture meets "
                        + "; ".join(_broken_text(resolved, item) for item in broken)
                        + f" to the relative {BOUND_RTOL:g} a budget is held to: the solver's best answer "
                        "breaks it by that much, and none is found with the bound tightened",
                        str(resolved[first.index][0]),
                        first.total,
                        [(str(resolved[item.index][0]), item.total) for item in broken],
                    )
                raise _diagnose(table, resolved, rules, options)
            raise SearchError(f"the solver stopped without a solution (status {outcome.status})")
        broken = broken_limits(table, outcome.choices, resolved)
        if not broken:
            break
        if attempt == RETIGHTEN:
            raise SearchError(
                f"the solver's answer {list(outcome.choices)} breaks "
                + "; ".join(_broken_text(resolved, item) for item in broken)
                + f" beyond the relative {BOUND_RTOL:g} a budget is held to, after {RETIGHTEN} re-solves "
                "with it tightened; try solver 'cbc' or 'highs' (the other one), or loosen the budget"
            )
        solving = _tightened(table, resolved, solving, broken, attempt)
    _check(table, outcome.choices, resolved, rules)
    return _make_solution(
        table,
        outcome.choices,
        outcome,
        outcome.solver or resolve_solver(options.solver),
        time.perf_counter() - started,
        problem.dropped,
    )


# How many times `search` solves again with a broken budget tightened before it refuses the answer.
RETIGHTEN = 4


def _broken_text(resolved, item: Broken) -> str:
    limit = resolved[item.index][0]
    side = "<=" if item.total > item.bound else ">="
    return (
        f"{limit} (total {item.total!r}, bound {side} {item.bound!r}: off by {item.excess:.3g}, "
        f"{item.relative:.3g} of the bound)"
    )


def _tightened(table: Table, resolved, solving, broken: Sequence[Broken], attempt: int) -> list:
    """`solving` with each broken limit's bound moved inside the budget (`resolved`'s) by a margin of at
    least twice the excess and 1e-7 of the row, times 4 per earlier attempt: beyond the solvers' tolerances
    after a try or two, and never looser than the bound before."""
    solving = list(solving)
    for item in broken:
        limit, lower, upper = resolved[item.index]
        _, solve_lower, solve_upper = solving[item.index]
        scale = row_scale(table, table.cost(limit.key), lower, upper)
        margin = max(2.0 * item.excess, 1e-7 * scale) * 4.0**attempt
        if item.total > item.bound:
            solve_upper = min(solve_upper, upper - margin)
        else:
            solve_lower = max(solve_lower, lower + margin)
        solving[item.index] = (limit, solve_lower, solve_upper)
        _log.info(
            "search: the solver's answer breaks %s; solving again with the bound tightened by %.3g "
            "(%.3g of it)",
            _broken_text(resolved, item),
            margin,
            margin / abs(item.bound) if item.bound else math.inf,
        )
    return solving


def search_k(
    table: Table,
    limits: Sequence[Bound] = (),
    rules: Rules | None = None,
    options: SolverOptions | None = None,
    k: int = 1,
    min_diff: int = 1,
) -> list[Solution]:
    """Up to k architectures, each the best that differs from every earlier one in >= min_diff blocks.

    The first is `search`'s; fewer than k come back when the library runs out of distinct ones.
    Dominance presolve is used for the first only (a dominated variant may be the second best).
    """
    rules, options = rules or Rules(), options or SolverOptions()
    if k < 1 or min_diff < 1:
        raise SearchError(f"need k >= 1 and min_diff >= 1, found k={k}, min_diff={min_diff}")
    solutions = [search(table, limits, rules, options)]
    while len(solutions) < k:
        try:
            solutions.append(search(table, limits, rules, options, [s.choices for s in solutions], min_diff))
        except InfeasibleError:
            break
    return solutions


def _best_reachable(
    table: Table, costs: np.ndarray, sense: int, bounds, rules: Rules, options: SolverOptions
) -> float | None:
    """min (sense=+1) or max (sense=-1) of the blocks' sum of `costs` under `bounds` and `rules`; None if none."""
    problem = build_problem(table, sense * costs, bounds, rules, presolve=options.presolve)
    outcome = _solve_problem(problem, options, None)
    if outcome.choices is None:
        return None
    rows = table.offsets[:-1] + np.asarray(outcome.choices)
    return float(costs[rows].sum())


def _diagnose(table: Table, resolved, rules: Rules, options: SolverOptions) -> InfeasibleError:
    """Which budget cannot be met: first each alone (under the rules), then each given all the others."""
    exact = dataclasses.replace(options, time_limit_s=None, gap_rel=0.0)
    zero = np.zeros(table.num_variants)
    if _best_reachable(table, zero, 1, [], rules, exact) is None:
        return InfeasibleError(
            "the global rules cannot be met by this library, whatever the budgets", None, None, []
        )

    def upper_misses(upper, low_best, fixed) -> bool:
        """The smallest reachable total breaks the upper bound (as `within_bounds` judges the answer)."""
        return upper is not None and not within_bounds(low_best + fixed, None, upper + fixed)

    def lower_misses(lower, high_best, fixed) -> bool:
        return lower is not None and not within_bounds(high_best + fixed, lower + fixed, None)

    def best_pair(index: int, others) -> tuple[float, float, float]:
        limit, lower, upper = resolved[index]
        costs = table.cost(limit.key)
        low = _best_reachable(table, costs, 1, others, rules, exact) if upper is not None else None
        high = _best_reachable(table, costs, -1, others, rules, exact) if lower is not None else None
        fixed = table.fixed.get(limit.key, 0.0)
        # The best value for this budget is the side it misses on (the smallest reachable for an upper bound).
        low = -math.inf if low is None else low
        high = math.inf if high is None else high
        return low, high, fixed

    for together in (False, True):
        details = []
        for index, (limit, lower, upper) in enumerate(resolved):
            others = []
            if together:
                others = [
                    (str(other), table.cost(other.key), lo, hi)
                    for j, (other, lo, hi) in enumerate(resolved)
                    if j != index
                ]
            low, high, fixed = best_pair(index, others)
            if not math.isfinite(low) and not math.isfinite(high):
                continue
            upper_missed = upper_misses(upper, low, fixed)
            if upper_missed or lower_misses(lower, high, fixed):
                best = low if upper_missed else high
                target = f"<= {upper + fixed:g}" if upper_missed else f">= {lower + fixed:g}"
                details.append((str(limit), best + fixed, target))
        if details:
            name, best, target = details[0]
            where = "on its own" if not together else "while the other budgets hold"
            listing = "; ".join(f"{n}: best reachable {b:g}" for n, b, _ in details)
            return InfeasibleError(
                f"budget {name} (total {target}) cannot be met {where}: the best this library reaches is "
                f"{best:g} ({listing})",
                name,
                best,
                [(n, b) for n, b, _ in details],
            )
    names = ", ".join(str(limit) for limit, _, _ in resolved)
    return InfeasibleError(
        f"the budgets {names} cannot be met together under the global rules", None, None, []
    )
